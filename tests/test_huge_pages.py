"""Packed weights in transparent huge pages (batchrun/models/huge_pages.py): the slab's tensors are aligned,
disjoint and bounded; where the OS offers THP their memory really is in 2 MiB pages (read back from
/proc/self/smaps); the engine packs into one and gives the same tokens as without."""
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu_gemm
from batchrun.models import huge_pages
from batchrun.models.huge_pages import HUGE_PAGES_ENV, Slab


def huge_kib_at(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds address `addr`."""
    inside, kib = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                kib = int(line.split()[1])
    assert kib is not None, f"no mapping holds {addr:#x}"
    return kib


def thp_setting() -> str:
    try:
        with open(huge_pages.THP_SETTING) as f:
            return f.read()
    except OSError:
        return ""


def test_available_follows_the_os_setting_and_the_switch(monkeypatch):
    mode = thp_setting()
    assert huge_pages.available() == ("[always]" in mode or "[madvise]" in mode)
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    assert not huge_pages.available()


def test_a_mapping_that_fails_falls_back_to_ordinary_pages(monkeypatch, caplog):
    if not huge_pages.available():
        assert huge_pages.slab_or_none([(4,)], torch.bfloat16) is None
        return

    def no_memory(*a, **k):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(huge_pages.mmap, "mmap", no_memory)
    monkeypatch.setattr(huge_pages, "_warned", False)
    with caplog.at_level("WARNING", logger="batchrun"):
        assert huge_pages.slab_or_none([(4,)], torch.bfloat16) is None
    assert "ordinary pages instead" in caplog.text


def test_slab_tensors_are_aligned_disjoint_and_bounded():
    shapes = [(3, 5), (64, 1024), (7,)]
    slab = Slab(shapes, torch.bfloat16)
    ts = [slab.take(s) for s in shapes]
    for t, s in zip(ts, shapes):
        assert t.shape == s and t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 64 == 0
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    assert [int(t.float().mean()) for t in ts] == [1, 2, 3]       # nothing overlaps
    with pytest.raises(ValueError, match="do not fit"):
        slab.take((1,))


@pytest.mark.skipif(not huge_pages.available(), reason="this OS offers no transparent huge pages (or THP is never)")
def test_slab_memory_is_in_huge_pages_once_written():
    slab = Slab([(8 << 20,)], torch.uint8)
    t = slab.take((8 << 20,))
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1)
    assert huge_kib_at(t.data_ptr()) >= 2048


def test_pack_into_out_equals_pack():
    w = torch.randn(128, 96).to(torch.bfloat16)
    for grouped in (False, True):
        shape = cpu_gemm.packed_shape(128, 96, grouped)
        out = torch.empty(shape, dtype=torch.bfloat16)
        assert cpu_gemm.pack(w, grouped, out=out) is out
        assert torch.equal(out, cpu_gemm.pack(w, grouped)) and torch.equal(cpu_gemm.unpack(out, 128), w)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        cpu_gemm.pack(w, False, out=torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.skipif(not cpu_gemm.supported(), reason="the own bf16 layout needs AVX-512 BF16 or AVX2")
def test_engine_packs_into_huge_pages_and_generates_the_same(hf_models, monkeypatch):
    path = hf_models["llama"][0]
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="bfloat16", max_num_seqs=4)
    w = llm.engine.runner.model.layers[0].mlp.down_proj.weight
    if huge_pages.available():
        assert huge_kib_at(w.data_ptr()) > 0
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    plain = LLM(path, dtype="bfloat16", max_num_seqs=4)
    if "[madvise]" in thp_setting():            # (with `always` any large allocation may get huge pages)
        assert huge_kib_at(plain.engine.runner.model.layers[0].mlp.down_proj.weight.data_ptr()) == 0
    assert [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == got
