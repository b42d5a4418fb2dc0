"""The run's last task, on every run, cached or not: the report, the quality gate and the promotion
(eaglet.report), then what the Prefect UI shows of them (markdown with the plots inline, tables, links)."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from eaglet.config import RunConfig
from eaglet.report import inline_images, ui_links, ui_tables, write_outputs
from eaglet.report.loads import engine_loads, loads_summary
from eaglet.verifier import VerifierInfo


@task(name="report-and-promote")
def report_and_promote(output_dir: str, params: RunConfig, verifier: VerifierInfo, tasks: dict,
                       artifacts: dict[str, str], smoke: dict | None, comparison: str, warm_start: dict | None,
                       started: float) -> dict:
    """DIR/report.{json,md}, plots, DIR/drafts/<key> and DIR/current moved to the new draft if it passes the gate
    and beats the current one on the same held-out prompts (eaglet.report.history). tasks: name -> {"state",
    "seconds", "started", "result"} of every task the flow ran."""
    loads = engine_loads(tasks, params.verifier.endpoint, started)
    report = write_outputs(Path(output_dir), params, verifier, tasks, artifacts, loads["data"], smoke,
                           engine_loads=loads, comparison=comparison, warm_start=warm_start)
    publish_report(str(Path(output_dir).resolve()))
    get_run_logger().info(f"{loads_summary(loads)}; {report['promotion']['reason']}")
    return report


def publish_report(output_dir: str) -> list[str]:
    """The report's UI artifacts; returns the keys of the artifacts it created."""
    out = Path(output_dir)
    report = json.loads((out / "report.json").read_text())
    keys = ["eaglet-report"]
    create_markdown_artifact(key="eaglet-report", markdown=inline_images((out / "report.md").read_text(), out),
                             description=f"train-eagle3 report ({out / 'report.md'})")
    for key, (table, description) in ui_tables(report, out).items():
        create_table_artifact(key=key, table=table, description=description)
        keys.append(key)
    for key, (link, text, description) in ui_links(report, out).items():
        create_link_artifact(key=key, link=link, link_text=text, description=description)
        keys.append(key)
    return keys
