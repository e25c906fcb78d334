"""Facts about the machine: its GPUs and links (``topology``, ``topo_matrix``, ``nvml``), the CUDA arch list (``cuda_arch``) and where a model's layers go (``placement``)."""
