"""The CPU backend must pass the whole conformance suite (the quick profile in CI)."""
from __future__ import annotations

import hashlib
import json

from plugin_build import PROFILE

from deepinfer import abi
from deepinfer.conformance import LEVELS, TOLERANCES_VERSION, run_conformance, summary


def test_cpu_library_passes_conformance(cpu_lib, tmp_path):
    out = tmp_path / "cpu-cert.json"
    cert = run_conformance(str(cpu_lib), levels=LEVELS, out=str(out), profile=PROFILE)
    assert cert["passed"], "the CPU backend fails conformance:\n" + summary(cert)
    # the certificate on disk is the one returned, with everything a vendor needs to cite
    on_disk = json.loads(out.read_text())
    assert on_disk["passed"] is True
    lib = on_disk["library"]
    assert lib["sha256"] == hashlib.sha256(cpu_lib.read_bytes()).hexdigest()
    assert lib["name"] == "cpu" and lib["abi_version"] == f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"
    assert on_disk["abi_version"] == f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"
    assert on_disk["tolerances"]["version"] == TOLERANCES_VERSION
    assert on_disk["tolerances"]["values"]["linear"]["f32"]["rtol"] > 0
    assert set(on_disk["levels"]) == set(LEVELS)
    for key in ("date", "deepinfer_version", "ops_claimed", "ops_passed", "ops_unimplemented"):
        assert key in on_disk
    # every op the CPU backend claims passed L1 (nothing may hide behind "unsupported" everywhere)
    assert on_disk["ops_passed"]["L1"] == on_disk["ops_claimed"]
    assert on_disk["levels"]["L2"]["counts"].get("pass", 0) > 50
    assert on_disk["levels"]["L0"]["counts"].get("pass", 0) > 100
    # the 1.1 entries were exercised, not skipped: events, host memory, async copies, per-thread errors;
    # and 1.4's communicators
    l0 = {r["case"]: r for r in on_disk["levels"]["L0"]["results"]}
    for case in ("events: create, record, wait, query, synchronize, destroy, NULLs",
                 "host_register / host_unregister: overlap and double unregister rejected",
                 "mem_copy_async: host -> device -> host through pinned memory on a stream",
                 "last_error is per thread: two threads failing on one context keep their own message",
                 "comm_unique_id / comm_create / comm_destroy: NULLs, nranks and rank out of range, "
                 "one-rank communicators"):
        assert l0[case]["status"] == "pass" and not l0[case].get("message", "").startswith("no "), l0[case]
    assert l0["1.4 communicators: comm_unique_id, comm_create, comm_destroy and the three collectives all six or "
              "none"]["message"].startswith("communicators yes")
    forged = [r for r in on_disk["levels"]["L0"]["results"] if r["case"].startswith("comm not made by comm_create")]
    assert sorted(r["op"] for r in forged) == ["all_gather", "all_reduce", "all_to_all"]
    assert all(r["status"] == "pass" for r in forged), forged
    # 1.5: moe_experts takes a 1.4 caller's struct and expert_map / misses both or neither, and its mapped
    # L1 cases ran (not "unsupported")
    n14 = abi.args_struct_size("moe_experts", 4)
    for case in (f"struct_size of ABI 1.4 ({n14}) -> accepted, fields of 1.5 ignored",
                 "expert_map without misses -> INVALID_ARGUMENT (1.5: both or neither)",
                 "misses without expert_map -> INVALID_ARGUMENT (1.5: both or neither)"):
        assert l0[case]["status"] == "pass", l0[case]
    mapped = [r for r in on_disk["levels"]["L1"]["results"] if r["op"] == "moe_experts" and "expert_map" in r["case"]]
    assert mapped and all(r["status"] == "pass" for r in mapped), [r for r in mapped if r["status"] != "pass"]
    l3 = [r for r in on_disk["levels"]["L3"]["results"] if r["case"].startswith("an event orders")]
    assert len(l3) == 1 and l3[0]["status"] == "pass", on_disk["levels"]["L3"]
