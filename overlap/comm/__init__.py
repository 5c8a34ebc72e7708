"""Collectives: quantized (INT8 / BF16) all-reduce, reduce-scatter and all-gather in
``overlap.comm.quant``."""
