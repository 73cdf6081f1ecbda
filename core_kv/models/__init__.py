"""The model adapter: per-family Q/K/V and RoPE access (``attention``), the ragged cache (``cache``), loading by name
(``loading``, ``packaged``) and the random-weight models built from config (``tiny``)."""
