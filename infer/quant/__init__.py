"""Quantization: the TBE row layout (``rowwise``), fp32 tables -> quantized model (``quantize``), and
its error against fp32 (``accuracy``). Import from the modules; this package stays light."""
