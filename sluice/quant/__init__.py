"""Quantized tensor formats -> math: the format table, reference-exact dequantization, packed CPU kernels."""
