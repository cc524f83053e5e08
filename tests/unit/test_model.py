import torch

from node.config.schema import load_config
from node.train.model import apply_rotary, build_model, rotary_table


def test_forward_shape_and_initial_loss_near_uniform():
    cfg = load_config()
    torch.manual_seed(0)
    model = build_model(cfg.model, 256)
    tokens = torch.randint(0, 256, (2, 32))
    assert model(tokens).shape == (2, 32, 256)
    with torch.no_grad():
        assert abs(float(model.loss(tokens, tokens)) - torch.log(torch.tensor(256.0))) < 0.3


def test_decoder_is_causal():
    cfg = load_config()
    torch.manual_seed(0)
    model = build_model(cfg.model, 256).eval()
    a = torch.randint(0, 256, (1, 24))
    b = a.clone()
    b[0, 12:] = (b[0, 12:] + 1) % 256
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.allclose(la[0, :12], lb[0, :12], atol=1e-5)
    assert not torch.allclose(la[0, 12:], lb[0, 12:], atol=1e-3)


def test_rotary_scores_depend_only_on_relative_position():
    cos, sin = rotary_table(16, 64, 10000.0)
    q, k = torch.randn(16), torch.randn(16)

    def score(i, j):
        qi = apply_rotary(q.view(1, 1, 1, 16), cos[i:i + 1], sin[i:i + 1])
        kj = apply_rotary(k.view(1, 1, 1, 16), cos[j:j + 1], sin[j:j + 1])
        return float((qi * kj).sum())

    assert abs(score(3, 1) - score(40, 38)) < 1e-4
    assert abs(score(3, 1) - score(3, 2)) > 1e-3


def test_tied_embeddings_share_storage():
    cfg = load_config(overrides=["model.tie_embeddings=true"])
    model = build_model(cfg.model, 256)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
