"""The plain decoder's answers to the family contract (trainer/models/hooks.py): the
contract's defaults are this family's, and it adds the build, which every family answers."""

from __future__ import annotations

from trainer.models.hooks import DecoderHooks


class LlamaHooks(DecoderHooks):
    def build(self, args):
        from trainer.models.common.decoder import Transformer

        return Transformer(args)


HOOKS = LlamaHooks()
