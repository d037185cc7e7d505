"""Engines that turn prompts into completions: `base` (the contract every engine keeps), `ar`
(autoregressive, continuous batching), `speculative` (proposals verified by the AR target),
`diffusion` (masked diffusion) and `structured` (output that follows a JSON Schema)."""
