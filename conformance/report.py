"""The audit's result presented: the report table (text) and JSON (format version 1)."""

from __future__ import annotations

import json
from typing import Any, TextIO

from kvspec.conformance.audit import AuditResult, LayerResult
from kvspec.conformance.counterexamples import first_lines, program_calls


def result_to_json(audit: AuditResult) -> dict[str, Any]:
    """The audit as plain JSON data (format version 1)."""
    return {
        "kvspec_audit": 1,
        "target": audit.target, "profile": audit.profile, "scope": audit.scope,
        "vllm_version": audit.vllm_version, "python": audit.python,
        "budget_seconds": audit.budget, "seconds": round(audit.seconds, 3), "seed": audit.seed,
        "step_deadline_seconds": audit.step_deadline,
        # Only where the audit was bounded by examples (``--examples``): a budget-bound
        # audit's JSON is as it was.
        **({} if audit.examples is None else {"examples_per_layer": audit.examples}),
        "verdict": audit.verdict, "conforms": audit.conforms,
        "baseline": audit.baseline, "new_failures": len(audit.new_failures),
        "layers": [_layer_json(layer) for layer in audit.layers],
    }


def _layer_json(layer: LayerResult) -> dict[str, Any]:
    return {
        "layer": layer.layer, "status": layer.status, "reason": layer.reason,
        "target_class": layer.target_class, "api": layer.api,
        "examples": layer.examples, "steps": layer.steps, "seconds": round(layer.seconds, 3),
        "interrupted": layer.interrupted, "conforms": layer.conforms, "notes": layer.notes,
        **{f"{kind}s": [{"name": r.name, "steps": r.steps, "verdict": r.verdict}
                        for r in layer.rows if r.kind == kind]
           for kind in ("rule", "situation", "invariant")},
        "excluded_after_failure": layer.excluded,
        "out_of_contract_skipped": layer.out_of_contract_skipped,
        "failures": [{
            "kind": f.kind, "check": f.check, "situation": f.situation, "error": f.error,
            "message": f.message, "rule": f.rule, "program": program_calls(f),
            "counterexample": f.counterexample, "known": f.known,
        } for f in layer.failures],
        "mutation_score": layer.mutation_score,
    }


def render_report(audit: AuditResult) -> str:
    """The conformance report as text: a table per layer, then the failures."""
    out: list[str] = []
    version = f" (vLLM {audit.vllm_version})" if audit.vllm_version else ""
    out.append(f"kvspec audit: target {audit.target}{version}, profile {audit.profile}, "
               f"scope {audit.scope}")
    bound = ("" if audit.examples is None
             else f"{audit.examples} examples per layer within a ")
    out.append(f"python {audit.python}; {bound}budget {audit.budget:g} s, ran "
               f"{audit.seconds:.1f} s, seed {audit.seed}, "
               + (f"step deadline {audit.step_deadline:g} s" if audit.step_deadline
                  else "no step deadline"))
    for layer in audit.layers:
        out.append("")
        if layer.status != "audited":
            out.append(f"== layer {layer.layer}: skipped ({layer.reason})")
            continue
        out.append(f"== layer {layer.layer}: {layer.target_class} driven through the "
                   f"{layer.api}")
        out.append(f"   {layer.examples} examples, {layer.steps} steps in {layer.seconds:.1f} s"
                   + (" (interrupted)" if layer.interrupted else ""))
        out.extend(f"   note: {note}" for note in layer.notes)
        width = max([len(r.name) for r in layer.rows] + [30])
        out.append(f"   {'check':<{width + 12}} {'steps':>8}  verdict")
        for row in layer.rows:
            label = {"rule": "rule", "situation": "  situation", "invariant": "invariant"}[
                row.kind]
            out.append(f"   {label:<11} {row.name:<{width}} {row.steps:>8}  {row.verdict}")
        score = layer.mutation_score
        if score is None:
            out.append("   mutation score of this machine: not measured "
                       "(run `make mutants` to measure it)")
        else:
            survivors = (f"; survivors: {', '.join(score['survivors'])}"
                         if score["survivors"] else "")
            out.append(f"   mutation score of this machine: {score['killed']}/{score['total']} "
                       f"mutants killed (measured {score['measured']}, {score['profile']} "
                       f"profile){survivors}")
        if layer.out_of_contract_skipped:
            skipped = ", ".join(layer.out_of_contract_skipped)
            out.append(f"   left out (--scope contract): {skipped}")
        for number, failure in enumerate(layer.failures, 1):
            out.append("")
            where = failure.check + (f" [{failure.situation}]"
                                     if failure.situation not in ("", failure.check) else "")
            known = " (known: in the baseline)" if failure.known else ""
            out.append(f"   FAILURE {number}{known}: {failure.kind} {where}: {failure.error}")
            for line in first_lines(failure.message).splitlines():
                out.append(f"     {line}")
            if failure.program:
                out.append("     minimal program (calls on the target's API):")
                for call in program_calls(failure):
                    out.append(f"       {call}")
            if failure.counterexample:
                out.append(f"     runnable: python -m pytest {failure.counterexample}")
    out.append("")
    summary = ""
    if audit.failures:
        summary = f" ({len(audit.failures)} discrepancies"
        if audit.baseline is not None:
            summary += (f", {len(audit.failures) - len(audit.new_failures)} known from "
                        f"{audit.baseline}, {len(audit.new_failures)} new")
        summary += ")"
    out.append(f"verdict: {audit.target} {audit.verdict} to {audit.profile}{summary}")
    return "\n".join(out) + "\n"


def write_json(audit: AuditResult, stream: TextIO) -> None:
    json.dump(result_to_json(audit), stream, indent=2)
    stream.write("\n")
