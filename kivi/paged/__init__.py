"""The paged KIVI core shared by kivi's paged hosts (:mod:`kivi.batching`, :mod:`kivi.vllm`): :mod:`.ring`, where
a request's full-precision rows live; :mod:`.counts`, how many of its tokens are in its sink, pages and window."""
