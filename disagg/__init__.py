"""disagg: disaggregated prefill/decode KV-cache transfer for TensorRT-LLM's connector API."""

__version__ = "0.1.0"
