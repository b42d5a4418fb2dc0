"""Every file a user hands over that cannot be read ends in one sentence (`eaglet: error: ...`), not a traceback:
data files, YAML configs, verifier and draft configs, reference configs, the prompts of `eaglet smoke`."""

from __future__ import annotations


import re
import shutil

import pytest

from eaglet.config import load_config
from eaglet.drafts.checkpoint import read_config
from eaglet.drafts.eagle3.reference import read_reference
from eaglet.data import read_conversations
from eaglet.errors import EagletError
from eaglet.verifier import resolve_verifier
from tests.conftest import run_cli

LATIN1 = '{"prompt": "caf\xe9"}\n'.encode("latin-1")


def test_data_file_that_is_not_utf8(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "fine"}\n' + LATIN1)
    with pytest.raises(EagletError, match="line 2 is not UTF-8 text"):
        read_conversations(f)


@pytest.mark.parametrize("text,words", [
    ("training: {epochs: 3\n", "is not valid YAML at line 2"),
    ("training:\n  epochs: 3\n   lr: 1\n", "is not valid YAML at line 3"),
])
def test_yaml_config_that_does_not_parse(tmp_path, text, words):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(EagletError, match=words):
        load_config(f)


def test_yaml_config_that_is_not_utf8(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"training:\n  note: caf\xe9\n")
    with pytest.raises(EagletError, match="is not UTF-8 text"):
        load_config(f)


@pytest.mark.parametrize("content,words", [(b"{not json", "is not valid JSON"), (b"[1, 2]", "must hold a JSON object"),
                                           (b'{"a": "\xe9"}', "is not UTF-8 text")])
def test_config_json_files(tiny_verifier, tmp_path, content, words):
    v = tmp_path / "v"
    shutil.copytree(tiny_verifier, v)
    (v / "config.json").write_bytes(content)
    with pytest.raises(EagletError, match="verifier config .* " + words):
        resolve_verifier(v)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_bytes(content)
    with pytest.raises(EagletError, match="draft config .* " + words):
        read_config(draft)
    with pytest.raises(EagletError, match="draft.like .* " + words):
        read_reference(draft)


def test_cli_says_it_in_one_line(tmp_path, tiny_verifier):
    """Through the command line, as a user meets it: exit 2 and one `eaglet: error:` line, no traceback."""
    bad_yaml = tmp_path / "c.yaml"
    bad_yaml.write_text("data: [\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(LATIN1)
    good_prompts = tmp_path / "ok.jsonl"
    good_prompts.write_text('{"prompt": "hi"}\n')
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{")
    smoke = ["smoke", "--verifier", str(tiny_verifier), "--draft", str(draft), "--prompts"]
    for args, words in ((["run", "--config", str(bad_yaml)], "is not valid YAML"),
                        (smoke + [str(prompts)], "is not UTF-8 text"),
                        (smoke + [str(good_prompts)], "draft config .* is not valid JSON"),
                        (["validate", str(draft), "--verifier", str(tiny_verifier)], "is not valid JSON")):
        proc = run_cli(args, timeout=300)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr.startswith("eaglet: error: ") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert re.search(words, proc.stderr), (words, proc.stderr)
