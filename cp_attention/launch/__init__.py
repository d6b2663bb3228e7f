"""Entry points: the local demo (``cp-attn``) and torchrun runners."""
