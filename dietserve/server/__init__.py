"""The inference server: KServe v2 / Triton gRPC protocol in front of a compiled artifact."""
