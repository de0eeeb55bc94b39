"""bench/torch_cp.py: torch 2.13's all-gather CP load balancers as bench/cp_attention.py counts them (analytic, no
ranks): the block counts PTRR reads are the document mask's non-empty blocks, the per-document balancer's order as torch
shards it and as its docstring draws it, and docs/cp.md's 8K row of the work table."""

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # the benches' modules, imported as they import each other

import cp_attention  # noqa: E402
import docs_tables  # noqa: E402
import torch_cp  # noqa: E402


def test_block_counts_are_the_non_empty_blocks_of_the_document_mask():
    """The key blocks each 128-token query block touches, from the dense mask (what a BlockMask's kv_num_blocks +
    full_kv_num_blocks count; checked once against FlexAttention's create_block_mask, whose first call costs ~15 s)."""
    cu = [0, 100, 300, 301, 700, 1024]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    pos = torch.arange(1024)
    dense = (pos[:, None] >= pos[None, :]) & (doc[:, None] == doc[None, :])
    touched = dense.view(8, 128, 8, 128).any(dim=3).any(dim=1).sum(dim=1)
    assert touched.tolist() == torch_cp.block_counts(cu).tolist() == [1, 2, 3, 2, 3, 4, 2, 3]


def test_per_document_order_as_sharded_and_as_drawn():
    # torch's docstring example: documents of 4, 8 and 4 tokens, cp 2; rank 0 holds the first 8 positions
    cu = [0, 4, 12, 16]
    shipped = torch_cp.rearrangement("per-document head-tail", cu, 2).tolist()
    drawn = torch_cp.rearrangement(torch_cp.AS_DRAWN, cu, 2).tolist()
    assert shipped[:8] == [0, 3, 1, 2, 4, 5, 10, 11]  # doc 0 whole, half of doc 1
    assert drawn[:8] == [0, 3, 4, 5, 10, 11, 12, 15]  # pieces 0 and 3 of every document, as drawn
    assert sorted(drawn) == list(range(16))
    work = torch_cp.token_work(cu)
    assert [int(w) for w in work[torch.tensor(drawn)].chunk(2)[0].sum().view(1)] == [int(work.sum()) // 2]


def test_cp_documents_keep_s_and_round_to_2cp():
    cu = torch_cp.cp_documents([0, 5, 17, 40, 1024], 4)
    assert cu[-1] == 1024 and all((b - a) % 8 == 0 and b > a for a, b in zip(cu, cu[1:]))
    with pytest.raises(ValueError, match="multiple of 2cp"):
        torch_cp.cp_documents([0, 1001], 4)


def test_the_torch_work_row_in_docs_is_what_the_bench_computes():
    with contextlib.redirect_stdout(io.StringIO()):
        record = {"bench": "cp_attention", "command": ["bench/cp_attention.py"],
                  "figures": {"torch_work": torch_cp.work_table([8192], 20, cp_attention.document_lengths)}}
    rendered = docs_tables.render("torch-cp-work", record)
    assert rendered.splitlines()[2].startswith("| 8K | 2 / 4 / 8 | ")
    assert docs_tables.missing_lines(rendered, (ROOT / "docs/cp.md").read_text()) == []


def test_the_timed_table_in_docs_is_the_saved_run_rendered():
    """docs/cp.md's forward table beside torch's FlexAttention CP (a timing run, not repeatable in a test) is what
    bench/docs_tables.py renders from the run's JSON, docs/runs/cp_torch_flex.json."""
    import json

    record = json.loads((ROOT / "docs/runs/cp_torch_flex.json").read_text())
    rendered = docs_tables.render("torch-cp-flex", record)
    assert "| torch ptrr |" in rendered and rendered.count("| l3plugin balanced | ") == 3
    assert docs_tables.missing_lines(rendered, (ROOT / "docs/cp.md").read_text()) == []
