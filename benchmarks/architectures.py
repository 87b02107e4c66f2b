"""The README's issue-7 tables on ddtp-en-de, from runs this script makes (not a timed test).

    python benchmarks/architectures.py arch   # encoder_decoder vs prefix_lm vs decoder_only
    python benchmarks/architectures.py kd     # teacher, student, student + word KD, student + sequence KD

Every run is the quickstart recipe (recipes/quickstart.yaml: its data, tokenizer,
schedule and 2 threads) for the same wall-clock budget (``--minutes``, default 5),
then BLEU of beam-5 translations of the 1000 test sentences.  ``arch`` changes only
``model.arch`` (the one-stack models get enc_layers + dec_layers blocks).  ``kd`` uses
the quickstart model (``--teacher-minutes``, default 30) as the
teacher and a student of half the width and fewer layers; word-level KD is train.distill
(lambda 0.5, T 2); sequence-level KD trains
the student on the teacher's greedy translations of the training sources
(``s2s distill``; greedy, as beam 5 over 45k sentences would take most of an hour
on 2 cores).  Prints a Markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "quickstart.yaml"
TEST_SRC, TEST_REF = ROOT / "data/ddtp-en-de/test.en.gz", ROOT / "data/ddtp-en-de/test.de.gz"
STUDENT = ["model.d_model=96", "model.heads=4", "model.enc_layers=2", "model.dec_layers=1", "model.d_ff=384"]


def s2s(*args: str, stdout=None) -> None:
    cmd = [sys.executable, "-m", "s2s", *map(str, args)]
    print("+ s2s " + " ".join(map(str, args)), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=stdout)


def train_and_score(name: str, out: Path, minutes: int, sets: list[str], reuse: bool,
                    recipe: Path = RECIPE) -> dict:
    run = out / name
    if not (reuse and (run / "model.json").is_file()):
        shutil.rmtree(run, ignore_errors=True)
        s2s("train", recipe, "-o", run, *[a for s in [*sets, f"train.max_time={minutes}m"] for a in ("--set", s)])
    hyp, src, ref = run / "test.hyp", out / "test.en", out / "test.de"
    src.write_bytes(gzip.decompress(TEST_SRC.read_bytes()))
    ref.write_bytes(gzip.decompress(TEST_REF.read_bytes()))
    with open(hyp, "wb") as f:
        s2s("translate", "-m", run, "--beam", "5", "--input", src, stdout=f)
    score = subprocess.run([sys.executable, "-m", "s2s", "score", hyp, ref, "--json"], cwd=ROOT, check=True,
                           capture_output=True, text=True)
    meta = json.loads((run / "model.json").read_text())
    from s2s.model import count_parameters
    from s2s.modeldir import load_model_dir

    params = f"{count_parameters(load_model_dir(run).model):,}"
    return {"name": name, "params": params, "steps": meta["step"], "dev_loss": meta.get("dev_loss"),
            "bleu": round(json.loads(score.stdout)["bleu"]["score"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=["arch", "kd"])
    ap.add_argument("--minutes", type=int, default=5)
    ap.add_argument("--teacher-minutes", type=int, default=30, help="kd: the teacher's budget")
    ap.add_argument("--out", type=Path, default=ROOT / "exp" / "issue7")
    ap.add_argument("--reuse", action="store_true", help="keep runs that already finished in --out")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        s2s("tokenizer", "train", RECIPE)
        s2s("prepare", RECIPE)
    rows = []
    if args.table == "arch":
        for arch in ("encoder_decoder", "prefix_lm", "decoder_only"):
            rows.append(train_and_score(arch, out, args.minutes, [f"model.arch={arch}"], args.reuse))
    else:
        rows.append(train_and_score("teacher", out, args.teacher_minutes, [], args.reuse))
        teacher = out / "teacher"
        rows.append(train_and_score("student", out, args.minutes, STUDENT, args.reuse))
        rows.append(train_and_score("student + word KD", out, args.minutes, STUDENT + [
            f"train.distill.teacher={teacher}", "train.distill.lambda=0.5", "train.distill.temperature=2"], args.reuse))
        kd_dir = out / "seqkd"
        kd_dir.mkdir(exist_ok=True)
        s2s("distill", RECIPE, "-m", teacher, "-o", kd_dir / "train", "--beam", "1")
        prepared = ROOT / "prepared" / "quickstart"
        kd_data = out / "seqkd-prepared"
        kd_data.mkdir(exist_ok=True)
        for f in ("spm.model", "tokenizer.json"):  # the student keeps the quickstart tokenizer
            shutil.copyfile(prepared / f, kd_data / f)
        sets = [f"data.train={kd_dir / 'train'}", f"data.dir={kd_data}"]
        s2s("prepare", RECIPE, *[a for s in sets for a in ("--set", s)])
        rows.append(train_and_score("student + sequence KD", out, args.minutes, STUDENT + sets, args.reuse))
    print("| run | parameters | steps | dev loss | test BLEU |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['name']} | {r['params']} | {r['steps']} | {r['dev_loss']} | {r['bleu']} |")
    print(json.dumps({"minutes": args.minutes, "runs": rows}))


if __name__ == "__main__":
    main()
