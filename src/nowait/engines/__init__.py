"""Engines that turn prompts into completions: autoregressive and masked diffusion."""
