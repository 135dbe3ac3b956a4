"""Scoring of tuned-vs-base generations."""

from jaxsft import evaluate
from jaxsft.data import synthetic


def test_generated_tasks_are_scored_on_the_answer_line_with_a_format_rate():
  records = synthetic.make_dataset(4, seed=3)
  answers = [f"Answer: {r['answer']}" for r in records]
  out = evaluate.task_score(records, [answers[0], "Answer: wrong", "The answer is " + records[2]["answer"], answers[3]])
  assert out["score"] == 0.5 and out["format_rate"] == 0.75 and out["n"] == 4


def test_gsm8k_style_references_are_scored_on_the_final_number():
  record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "2 + 2 = 4\n#### 4"}]}
  assert evaluate.score_reply(record, "so the total is\n#### 4")
  assert not evaluate.score_reply(record, "#### 5")
  assert not evaluate.score_reply(record, "4")


def test_other_references_need_an_exact_match_up_to_whitespace():
  record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Paris is  the capital."}]}
  assert evaluate.score_reply(record, " Paris is the capital. ")
  assert not evaluate.score_reply(record, "Paris")


def test_references_longer_than_max_new_tokens_are_counted_and_named(tokenizer):
  """A reply stops at eval.max_new_tokens: references that do not fit cannot match (a GSM8K number
  comes last), and the comparison says how many, where the score alone would read as a failure."""
  def record(reply):
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]}

  short, long = record("4"), record("First add the apples and the pears, then halve it.\n#### 12")
  n_long = len(tokenizer.encode(evaluate.reference_reply(long), add_special_tokens=False))
  assert evaluate.references_cut_short(tokenizer, [short, long], n_long) is None
  assert evaluate.references_cut_short(tokenizer, [short, long, long], n_long - 1) == {"count": 2, "of": 3,
                                                                                        "longest": n_long}
  out = {name: {"score": 0.0, "n": 2} for name in ("base", "tuned")}
  out["samples"] = []
  assert "references are longer" not in evaluate.format_comparison(out)
  out["references_cut_short"] = {"count": 1, "of": 2, "longest": n_long, "max_new_tokens": 16}
  assert (f"1 of 2 references are longer than eval.max_new_tokens=16 (the longest: {n_long} tokens)"
          in evaluate.format_comparison(out))
