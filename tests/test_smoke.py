import torch

import multihead as mh


def test_public_names():
    for name in ("attention", "attention_reference", "AttentionOutput", "MultiHeadAttention", "masks"):
        assert hasattr(mh, name)


def test_demo_seed_parity(capsys):
    from multihead.demo import seeds

    assert seeds.run(seed=1) == 0
    assert "OK" in capsys.readouterr().out


def test_module_self_attention_shape():
    mha = mh.MultiHeadAttention(32, 4)
    assert mha(torch.randn(2, 3, 32)).shape == (2, 3, 32)
