"""kvspec's fast, vLLM 0.13-compatible KV-cache block management (checked against spec/)."""
