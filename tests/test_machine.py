"""machine.py: /proc/cpuinfo and /proc/meminfo parsing on canned text, CPU classes, labels and this machine's info."""

import json

import pytest

from dyntree_core import machine
from dyntree_core.machine import MachineInfo, cpu_class, gpu_short_name, machine_info, parse_cpu_signature, parse_cpuinfo

# Sapphire Rapids (AMX) as a cloud VM shows it; two processors, only the first is read.
XEON_AMX = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
stepping\t: 8
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss \
ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni \
pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm \
3dnowprefetch fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm avx512f avx512dq rdseed adx smap avx512ifma \
clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 arat \
avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq \
la57 rdpid cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 \
arch_capabilities
bogomips\t: 5399.99

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu
"""

EPYC_AVX2 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid \
tsc_known_freq pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor \
lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext ssbd ibrs ibpb stibp vmmcall \
fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 clzero \
xsaveerptr arat npt nrip_save umip rdpid
"""


def test_parse_xeon_amx():
    model, flags = parse_cpuinfo(XEON_AMX)
    assert model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert flags == ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                     "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
    assert cpu_class(flags) == "amx"


def test_parse_epyc_avx2():
    model, flags = parse_cpuinfo(EPYC_AVX2)
    assert model == "AMD EPYC 7B12 64-Core Processor"
    assert flags == ("avx", "avx2", "fma", "f16c")
    assert cpu_class(flags) == "avx2"


def test_cpu_signature_tells_hosts_of_one_model_name_apart():
    assert parse_cpu_signature(XEON_AMX) == "GenuineIntel family 6 model 143 stepping 8"  # the first CPU only
    assert parse_cpu_signature(EPYC_AVX2) == "AuthenticAMD family 23 model 49"
    vm = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
          "stepping\t: 1\nmicrocode\t: 0x1000065\ncpu MHz\t\t: 2445.430\ncache size\t: 512 KB\n\n"
          "processor\t: 1\ncpu MHz\t\t: 3000.000\n")
    assert parse_cpu_signature(vm) == "AuthenticAMD family 25 model 1 stepping 1 microcode 0x1000065 cache 512 KB MHz 2445"
    assert parse_cpu_signature(vm.replace("2445.430", "2994.1")) != parse_cpu_signature(vm)
    assert parse_cpu_signature("") == "" and parse_cpu_signature("Features\t: fp asimd\n") == ""
    assert parse_cpu_signature("cpu MHz : fast\n") == ""  # an unreadable clock is left out


def test_parse_empty():
    assert parse_cpuinfo("") == (None, ())
    assert cpu_class(()) == "other"


def test_cpu_class_order():
    assert cpu_class({"avx2", "avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert cpu_class(["avx2", "avx512f"]) == "avx512"
    assert cpu_class(("avx", "fma")) == "other"
    # flags without a space-separated exact match are not picked up by substring
    assert parse_cpuinfo("flags : avx512fx avx2x\n")[1] == ()


@pytest.mark.parametrize("name,short", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA H200", "h200"),
    ("Tesla T4", "t4"), ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
])
def test_gpu_short_name(name, short):
    assert gpu_short_name(name) == short


def test_short_label():
    base = dict(cpu_model="x", cpu_flags=("avx2",), cpu_class="avx2", logical_cpus=2, torch_threads=2,
                torch="2", python="3", platform="p", gpu=None)
    assert MachineInfo(**base).short_label() == "cpu-avx2"
    assert MachineInfo(**(base | {"cpu_class": "amx"})).short_label() == "cpu-amx"
    assert MachineInfo(**(base | {"gpu": "NVIDIA H100 80GB HBM3"})).short_label() == "cuda-h100"


def test_this_machine():
    info = machine_info()
    assert info is machine_info()  # cached
    assert info.cpu_model
    assert info.cpu_class in ("amx", "avx512_bf16", "avx512", "avx2", "other")
    assert info.cpu_class == cpu_class(info.cpu_flags)
    assert info.logical_cpus >= 1 and info.torch_threads >= 1
    d = json.loads(json.dumps(info.to_dict()))
    assert d["cpu_model"] == info.cpu_model and d["cpu_flags"] == list(info.cpu_flags)
    assert d["cpu_signature"] == info.cpu_signature == machine.parse_cpu_signature(machine._read_cpuinfo())
    label = info.short_label()
    assert label and all(c.isalnum() or c in "-_" for c in label)


def test_machine_info_without_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "CPUINFO_PATH", tmp_path / "missing")
    machine.machine_info.cache_clear()
    try:
        info = machine.machine_info()
        assert info.cpu_model and info.cpu_flags == () and info.cpu_class == "other" and info.cpu_signature == ""
    finally:
        machine.machine_info.cache_clear()


def test_parse_meminfo_available():
    text = "MemTotal:       32594392 kB\nMemFree:         1210532 kB\nMemAvailable:   18733876 kB\n"
    assert machine.parse_meminfo_available(text) == 18733876 * 1024
    assert machine.parse_meminfo_available("MemTotal:       32594392 kB\n") is None  # kernels before 3.14
    assert machine.parse_meminfo_available("MemAvailable:   n/a kB\n") is None


def test_available_memory_reads_meminfo(monkeypatch, tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n")
    monkeypatch.setattr(machine, "MEMINFO_PATH", path)
    assert machine.available_memory() == 1024 * 1024
    monkeypatch.setattr(machine, "MEMINFO_PATH", tmp_path / "missing")
    assert machine.available_memory() is None


def test_process_memory_reads_rss_and_peak_from_status_text():
    from dyntree_core.process_memory import ProcessMemory, parse_status, process_memory

    text = "Name:\tpython\nVmPeak:\t 9000000 kB\nVmHWM:\t 7340032 kB\nVmRSS:\t 2097152 kB\nThreads:\t4\n"
    assert parse_status(text) == ProcessMemory(rss=2097152 * 1024, peak=7340032 * 1024)
    assert parse_status(text).text() == "memory 2.1 GB (peak 7.5 GB)"
    assert parse_status("VmRSS:\t12 kB\n") is None and parse_status("VmRSS: x kB\nVmHWM: 1 kB") is None
    now = process_memory()
    assert now is not None and 0 < now.rss <= now.peak  # this machine has /proc
