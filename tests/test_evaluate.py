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
