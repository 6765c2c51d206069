"""GSM8K in its own format from a local file, end to end: `question`, and `answer` with the worked solution (several
lines, `<<48/2=24>>` calculator annotations) ending in `#### N`, as JSONL and as parquet (the hub's own format),
through a real lockstep pair on the embedded model; the rewards get the number after `####`."""

import json

import pandas as pd
import pytest

from harness.experiment import data as D
from harness.experiment.rewards import correctness_reward, format_reward
from harness.experiment.spec import load_spec

from conftest import DEFAULT_SPEC

# The first rows of GSM8K's `main` train split, verbatim.
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much "
                 "did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
                 "Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her "
                 "parents. How much more money does Betty need to buy the wallet?",
     "answer": "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 = "
               "$<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5"},
    {"question": "Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today, she read twice "
                 "as many pages as yesterday. If she wants to read half of the remaining pages tomorrow, how many "
                 "pages should she read?",
     "answer": "Maila read 12 x 2 = <<12*2=24>>24 pages today.\nSo she was able to read a total of 12 + 24 = "
               "<<12+24=36>>36 pages since yesterday.\nThere are 120 - 36 = <<120-36=84>>84 pages left to be read.\n"
               "Since she wants to read half of the remaining pages tomorrow, then she should read 84/2 = "
               "<<84/2=42>>42 pages.\n#### 42"},
]
GOLD = ["72", "10", "5", "42"]

# A reward of the user's kind that writes down what the harness hands it, so the test sees the `answer` column.
SPY = '''
import json, os

def spy(completions, answer, **kwargs):
    with open(os.environ["GSM8K_SPY"], "a") as fh:
        fh.write(json.dumps(list(answer)) + "\\n")
    return [0.0] * len(completions)
'''


def write_gsm8k(folder, kind: str):
    if kind == "jsonl":
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    else:
        path = folder / "train-00000-of-00001.parquet"
        pd.DataFrame(GSM8K_ROWS, columns=["question", "answer"]).to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_gsm8k_rows_load_with_the_answer_after_the_hashes(tmp_path, kind):
    path = write_gsm8k(tmp_path, kind)
    spec = load_spec(DEFAULT_SPEC, ['data.source="file"', f'data.path="{path}"', "data.size=0"])
    rows = D.to_prompt_rows(D.load_rows(spec.data))
    assert [r["answer"] for r in rows] == GOLD
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K_ROWS[0]["question"]}]
    # the correctness reward reads the number after ####, not the calculator annotations or the reasoning's numbers
    solution = GSM8K_ROWS[0]["answer"]
    assert correctness_reward(solution, rows[0]["answer"]) == 1.0 and format_reward(solution) == 1.0
    assert correctness_reward("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 24", rows[0]["answer"]) == 0.0


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_gsm8k_file_runs_a_lockstep_pair_end_to_end(tmp_path, kind, monkeypatch):
    from harness.diagnose.matrix import run_matrix
    from harness.runlog.log import read_run

    (tmp_path / "spy.py").write_text(SPY)
    spied = tmp_path / "answers.jsonl"
    monkeypatch.setenv("GSM8K_SPY", str(spied))
    path = write_gsm8k(tmp_path, kind)
    spec_path = tmp_path / "gsm8k.toml"  # the data file named relative to the spec, as a user writes it
    text = DEFAULT_SPEC.read_text().replace("STEPS = 30", "STEPS = 2")
    text = text.replace('source = "synthetic"', f'source = "file"\npath = "{path.name}"')
    text = text.replace('functions = ["correctness", "format"]', 'functions = ["correctness", "format", "spy.py:spy"]')
    spec_path.write_text(text.replace("weights = [1.0, 0.5]", "weights = [1.0, 0.5, 1.0]"))
    spec = load_spec(spec_path, ["data.size=0"])
    assert spec.data.path == str(path)
    doc = run_matrix(spec, tmp_path / "run", "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity" and doc["ok"], cell
    for side in ("scratch", "trl"):
        run = read_run(tmp_path / "run" / "as-given" / side)
        assert len(run) == 2 and "rewards/spy/mean" in run.columns
        shown = [json.loads(line) for line in (tmp_path / "run" / "as-given" / side / "completions.jsonl").open()]
        assert {s["prompt"][-1]["content"] for s in shown} <= {r["question"] for r in GSM8K_ROWS}
    answers = {a for line in spied.read_text().splitlines() for a in json.loads(line)}
    assert answers and answers <= set(GOLD)  # both sides' rewards got the number after ####, nothing else
