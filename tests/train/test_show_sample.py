"""accutrain-check --show-sample[=N]: a training sample with the tokens the loss counts marked (chat masking,
prompt masking, packed documents), and what it cannot show in one line."""
import json
import re

import pytest
from conftest import assert_one_line_user_error, captured_log, run_of

from accutrain.cli.main import take_show_sample
from accutrain.errors import UserError
from accutrain.train.show_sample import show_sample


def test_chat_and_prompt_masking_and_packed_documents_are_shown(tmp_path, compose):
    pytest.importorskip("datasets")
    chats = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} plus 1?"},
                           {"role": "assistant", "content": f"{i + 1}."}]} for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    base = ["data=hf", f"data.train={tmp_path / 'chat.jsonl'}", "data.val_fraction=0.25",
            f"data.cache_dir={tmp_path / 'cache'}"]
    shown = show_sample(run_of(*base), 0)
    _, counts, body = shown.split("\n", 2)
    i = int(re.search(r"<\|user\|>\n(\d+) plus", body).group(1))
    assert body == f"<|system|>\nBe brief.\n<|user|>\n{i} plus 1?\n<|assistant|>\n⟦{i + 1}.\n<eos>⟧"  # the answer only
    assert counts.startswith(f"{len(body.encode()) - len('⟦⟧'.encode()) - len('<eos>') + 1} tokens, "
                             f"{len(str(i + 1)) + 3} counted in the loss")
    packed = show_sample(run_of(*base, "data.packing=true"), 0)
    assert "── document 2 ──" in packed and "packed documents" in packed and packed.count("⟦") >= 2
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}: ", "response": "ok"}) + "\n"
                                                  for i in range(6)))
    pairs = show_sample(run_of("data=text", f"data.train={tmp_path / 'pairs.jsonl'}", "data.val_fraction=0.2"), 1)
    assert pairs.split("\n", 2)[2].endswith(": ⟦ok<eos>⟧")
    with pytest.raises(UserError) as info:
        show_sample(run_of(*base), 99)
    assert_one_line_user_error(info.value, "--show-sample=99: the training split has 6 samples")
    with pytest.raises(UserError) as info:
        show_sample(run_of("data=digits"), 0)
    assert_one_line_user_error(info.value, "--show-sample shows a language-modelling sample")


def test_the_option_is_taken_out_of_the_command_line():
    argv = ["accutrain-check", "data=hf", "--show-sample=3"]
    assert take_show_sample(argv) == 3 and argv == ["accutrain-check", "data=hf"]
    assert take_show_sample(argv := ["x", "--show-sample"]) == 0 and argv == ["x"]
    assert take_show_sample(["x"]) is None
    with pytest.raises(SystemExit) as exit_info:
        take_show_sample(["x", "--show-sample=a"])
    assert exit_info.value.code == 2


def test_a_truncated_record_is_marked_where_it_was_cut_and_the_load_names_its_line(tmp_path):
    pytest.importorskip("datasets")
    long = {2, 5, 6, 7, 9, 10, 11}  # the records longer than data.max_length=64: lines 3, 6, 7, 8, 10, …
    chats = [{"messages": [{"role": "user", "content": f"{i} plus 1?"}, {"role": "assistant", "content": (
        f"{i + 1}, and a long explanation of why that is so. " * 4 if i in long else f"{i + 1}.")}]} for i in range(12)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    run = run_of("data=hf", f"data.train={tmp_path / 'chat.jsonl'}", f"data.val={tmp_path / 'chat.jsonl'}",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=64")
    with captured_log() as log:
        cut, whole = show_sample(run, 2), show_sample(run, 0)
    assert "truncated: the record is longer than data.max_length=64, cut at ✂" in cut
    assert cut.endswith("a long explanation of wh⟧✂[cut at data.max_length=64]")
    assert "✂" not in whole and "truncated" not in whole.split("\n", 1)[1]  # (the first line names tmp_path)
    assert (f"data.train={tmp_path / 'chat.jsonl'}: 12 records read, 7 truncated at data.max_length=64 "
            "(lines 3, 6, 7, 8, 10, and 2 more)") in log.getvalue()
