"""The internode kernels on NVSHMEM (``v2``, ``v2_ll``): config and regions (``cfg``), specs,
tuning table, the variant walk, the kernel set the hip backend launches, and error messages."""
