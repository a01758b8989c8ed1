"""Optional compute kernels (Triton). Nothing here is imported unless implementation="triton" is used."""
