"""Profiling: device-neutral ranges (``nvtx``) that show up in Nsight Systems on GPUs and in
torch.profiler traces everywhere, so the overlap of every chunk's comm and GEMM can be seen and
measured on the CPU twin too; the one naming scheme for them (``names``); and the analyzer that
reads either kind of trace back (``analyze``, the ``overlap-analyze`` command)."""
