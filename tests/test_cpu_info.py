"""cpu_info names a machine kind finely enough that two CPUs sharing a model name (Zen 4 and Zen 5 both say
"AMD EPYC" under KVM) get their own kernel-choice cache entries and benchmark baselines."""
from batchrun.models import cpu_info

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni
bogomips\t: 5192.19

processor\t: 1
cpu family\t: 99
model name\t: something else
flags\t\t: fpu
"""
ZEN5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")
AVX2 = """processor\t: 0
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) CPU
flags\t\t: fpu avx2 fma
"""


def test_the_first_processor_block_gives_model_family_and_isa_flags():
    info = cpu_info.parse_cpuinfo(ZEN4.splitlines(True))
    assert info == {"model": "AMD EPYC", "family": "family 25 model 17",
                    "flags": ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]}


def test_two_cpus_with_one_model_name_are_two_machine_kinds():
    kinds = {cpu_info.kind_of({**cpu_info.parse_cpuinfo(t.splitlines(True)), "cores": 2}) for t in (ZEN4, ZEN5)}
    assert kinds == {"AMD EPYC family 25 model 17 (AVX-512 BF16, VNNI; 2 cores)",
                     "AMD EPYC family 26 model 2 (AVX-512 BF16, VNNI; 2 cores)"}
    assert cpu_info.kind_of({**cpu_info.parse_cpuinfo(AVX2.splitlines(True)), "cores": 4}) == \
        "Intel(R) Xeon(R) CPU family 6 model 85 (AVX2; 4 cores)"


def test_without_family_fields_the_kind_is_the_model_name_alone():
    info = cpu_info.parse_cpuinfo(["model name\t: Some CPU\n", "flags\t\t: avx2\n"])
    assert info["family"] == "" and cpu_info.kind_of({**info, "cores": 1}) == "Some CPU (AVX2; 1 cores)"


def test_the_kernel_choice_cache_is_keyed_by_the_family():
    from batchrun.models import kernel_choice
    assert kernel_choice.signature([(8, 8)], 1)["family"] == cpu_info.cpu_info()["family"]
