"""The intranode kernels (one node, over the symmetric arena): their config and arena regions
(``cfg``, ``args``), specs, tuning table, error messages and the MoE views of their outputs."""
