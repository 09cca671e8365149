import sys

import numpy as np
import pytest

from dynatrain.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer


def test_byte_round_trip_of_any_unicode():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # naïve ≠ 東京 🚀\x00"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    arr = tok.encode_array(text)
    assert arr.dtype == np.uint16 and arr.tolist() == ids
    assert tok.decode(arr) == text


def test_byte_specials_and_vocab():
    tok = ByteTokenizer()
    assert (tok.BOS, tok.EOS, tok.PAD, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.eos_id == 257
    # Specials carry no text.
    assert tok.decode([tok.BOS, 104, 105, tok.EOS, tok.PAD]) == "hi"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([259])


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="byte"):
        load_tokenizer("gpt2")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_hf_tokenizer_without_the_package_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HFTokenizer(path)


def test_hf_tokenizer_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 4 and tok.eos_id == 1
    assert tok.encode("hello world") == [2, 3]
    assert tok.identity.startswith("hf-") and tok.identity != ByteTokenizer().identity


def test_check_vocab_refuses_a_small_model():
    tok = ByteTokenizer()
    check_vocab(tok, 512)
    check_vocab(tok, 259)
    with pytest.raises(ValueError, match="vocab_size is 258 .* needs 259"):
        check_vocab(tok, 258)
    with pytest.raises(ValueError, match=">= 70000"):
        check_vocab(70000, 65536)
