"""Triton twins of the torch kernels. Importing this package imports triton: keep it lazy.

Set TRITON_INTERPRET=1 before importing to run them on CPU (tests do, in fp32/fp16).
"""
