"""A tied output projection after a layerwise reload (app/vllm/worker.py `retie_output_embedding`): the reload
gives the input embedding a new parameter and puts the old one back on `lm_head`; the head must follow the
embedding again and its kernel be rebuilt. No vLLM: plain modules in vLLM's shape."""

from types import SimpleNamespace

import torch

from app.vllm.worker import retie_output_embedding


class _Method:
    def __init__(self) -> None:
        self.rebuilt: list[torch.Tensor] = []

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.rebuilt.append(layer.weight)


def _model(tied: bool) -> tuple[torch.nn.Module, _Method]:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(5, 3)
    model.lm_head = torch.nn.Module()
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(5, 3))  # the parameter held before the reload
    model.lm_head.quant_method = _Method()
    return model, model.lm_head.quant_method


def test_a_tied_head_follows_the_reloaded_embedding_and_is_rebuilt():
    model, method = _model(True)
    cfg = SimpleNamespace(get_text_config=lambda: SimpleNamespace(tie_word_embeddings=True))
    assert retie_output_embedding(model, cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert method.rebuilt == [model.model.embed_tokens.weight]


def test_an_untied_head_is_left_alone():
    model, method = _model(False)
    old = model.lm_head.weight
    assert not retie_output_embedding(model, SimpleNamespace(tie_word_embeddings=False))
    assert model.lm_head.weight is old and method.rebuilt == []
