"""An offline RULER-style long-context suite (``kivi eval longctx``): tasks generated from any text at exact
token lengths (:mod:`.tasks`, :mod:`.haystack`), RULER's scoring (:mod:`.scoring`), one full-precision
prefill replayed into every compared cache and two prefill protocols (:mod:`.runner`), paired bootstrap
statistics (:mod:`.stats`, :mod:`.summary`), a table and a plot (:mod:`.report`). docs/evaluation.md,
"Long-context suite"."""
