"""The paged KIVI core shared by kivi's paged hosts (:mod:`kivi.batching`, :mod:`kivi.vllm`), framework-free torch.

:mod:`.ring`, where a request's full-precision rows live; :mod:`.counts`, how many of its tokens are in its sink,
pages and window; :mod:`.step`, the pieces of a layer's step (exits, a request's view, the all-or-nothing commit);
:mod:`.decode`, the one paged decode kernel call. A layer's whole step over block and ring tables is
:func:`.forward.paged_step` (with :mod:`.geometry`, :mod:`.plan`, :mod:`.decode_call`, :mod:`.write`), which the vLLM
plugin runs; no module here imports a host framework."""
