"""What the intranode and internode kernel families share: payload arithmetic and the legs (``cfg``),
the kernels' named constants (``consts``), a rank's share of the SMs (``grid``), the host-side views
and error words (``host``, ``wait_errors``). Imports nothing of the families above it."""
