"""Running a step plan on the device: the runner (tensors, forward, logits), KV cache, CUDA graphs (decode and
piecewise), the memory plan and the host staging buffers. It makes no scheduling decision."""
