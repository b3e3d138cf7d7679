"""The built-in architectures of the model registry: the pure-torch builders of
:mod:`psg_core.architectures`, each with the signature that lets the frontend reject batches that
do not fit before any worker sees them, and the Hugging Face family (:mod:`psg_server.huggingface`).

>>> registry = ModelRegistry()
>>> register_builtins(registry)
>>> [entry.name for entry in registry.entries()][:2]
['cnn_groupnorm', 'embedding_bag_classifier']
"""

from __future__ import annotations

from psg_core.architectures import (cnn_groupnorm, embedding_bag_classifier, lstm_classifier, mlp,
                                    resnet_groupnorm, transformer_classifier)
from psg_server.huggingface import register_huggingface
from psg_server.models import InputSpec, ModelRegistry, ModelSignature

__all__ = ["cnn_groupnorm", "embedding_bag_classifier", "lstm_classifier", "mlp", "register_builtins",
           "resnet_groupnorm", "transformer_classifier"]


def _mlp_signature(*, in_features: int, hidden: tuple[int, ...], num_classes: int) -> ModelSignature:
    return ModelSignature(inputs=(InputSpec("float", (in_features,)),), num_outputs=num_classes)


def _image_signature(*, in_channels: int, image_size: int, num_classes: int, **_: object) -> ModelSignature:
    return ModelSignature(inputs=(InputSpec("float", (in_channels, image_size, image_size)),),
                          num_outputs=num_classes)


def _token_signature(*, vocab_size: int, max_len: int, num_classes: int, **_: object) -> ModelSignature:
    return ModelSignature(inputs=(InputSpec("index", ((1, max_len),), num_embeddings=vocab_size),),
                          num_outputs=num_classes)


def register_builtins(registry: ModelRegistry) -> None:
    """Registers every architecture of this module and the Hugging Face family."""
    registry.register("mlp", mlp, signature=_mlp_signature)
    registry.register("cnn_groupnorm", cnn_groupnorm, signature=_image_signature)
    registry.register("resnet_groupnorm", resnet_groupnorm, signature=_image_signature)
    registry.register("transformer_classifier", transformer_classifier, signature=_token_signature)
    registry.register("lstm_classifier", lstm_classifier, signature=_token_signature)
    registry.register("embedding_bag_classifier", embedding_bag_classifier, signature=_token_signature)
    register_huggingface(registry)
