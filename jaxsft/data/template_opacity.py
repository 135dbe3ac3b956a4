"""Whether a chat template treats message contents as opaque text, proved from its syntax tree.

A template is *content-opaque* when what it renders for a conversation depends only on the
conversation's shape (each message's role, and whether its content is empty), with every content
written out verbatim where the template outputs it. For such a template the text of a record is
its shape's sentinel render (`SpanRenderer`) with the contents put back, and rendering the record
itself would only repeat that (a Jinja render costs about as much as the rest of a record's
preparation for the token store together).

The proof is conservative: a template passes only if every way it can reach a content is one of
a few forms whose result cannot depend on the content's characters. In the template's tree:

  - `messages` is used only as `for m in messages` (no filter, not recursive), `messages[i]`
    with a constant integer i, or `messages | length`;
  - a message (the loop variable `m`, or `messages[i]`) is used only through `['role']` /
    `.role` (the role is part of the shape) or `['content']` / `.content`;
  - a content is used only
      * written out: directly in `{{ }}`, or through `+` / `~` whose result is written out;
      * as a truth value (its emptiness is part of the shape): the test of an `if` or of
        `a if test else b`, possibly under `not` / `and` / `or` that are themselves such a test;
      * in a type test (`is string`, `is defined`, `is undefined`, `is none`): a normalized
        record's contents are always strings;
  - nothing captures or transforms output (`{% set %}...{% endset %}`, `{% filter %}`, macros,
    call blocks, includes and imports), the loop and message names are bound nowhere else, and
    no loop reaches a neighbouring message (`loop.previtem` / `loop.nextitem`).

Anything else (a filter such as `trim`, a method such as `.strip()`, `in`, a comparison, a
`set` of the content, `messages | selectattr(...)`, a slice `messages[1:]`) leaves the template
unproved, and every record is rendered and checked against its skeleton as before.
"""

from __future__ import annotations

from jinja2 import nodes

_CAPTURING = (nodes.AssignBlock, nodes.FilterBlock, nodes.Macro, nodes.CallBlock, nodes.Include, nodes.Import,
              nodes.FromImport, nodes.Extends, nodes.Block)
"""Nodes that capture, transform or pull in output: a content written inside one may be inspected."""

_TYPE_TESTS = frozenset({"string", "defined", "undefined", "none"})
"""Tests whose answer for a content does not depend on its characters (contents are strings)."""


def contents_opaque(source: str, environment) -> bool:
  """True when the chat template `source`, parsed by `environment` (the one that compiles it),
  provably renders a conversation as its shape's text with the contents written verbatim (the
  module docstring has the rules); False when it does not or cannot be shown to."""
  try:
    tree = environment.parse(source)
  except Exception:  # a template Jinja cannot parse here is not proved anything
    return False
  parent: dict[int, nodes.Node] = {}
  found: list[nodes.Node] = []

  def walk(node):
    found.append(node)
    for child in node.iter_child_nodes():
      parent[id(child)] = node
      walk(child)

  walk(tree)
  if any(isinstance(n, _CAPTURING) for n in found):
    return False
  if any(isinstance(n, nodes.Getattr) and n.attr in ("previtem", "nextitem") for n in found):
    return False
  loops = [n for n in found if isinstance(n, nodes.For) and _is_name(n.iter, "messages")]
  if any(not isinstance(n.target, nodes.Name) or n.recursive or n.test is not None for n in loops):
    return False
  message_names = {n.target.name for n in loops}
  loop_targets = {id(n.target) for n in loops}
  for n in found:  # the names are bound by the message loops and nowhere else
    if (isinstance(n, nodes.Name) and n.ctx != "load" and n.name in message_names | {"messages"}
        and id(n) not in loop_targets):
      return False
  up = lambda n: parent.get(id(n))  # noqa: E731
  for n in found:
    if _is_name(n, "messages"):
      p = up(n)
      if isinstance(p, nodes.For) and p.iter is n:
        continue
      if isinstance(p, nodes.Filter) and p.node is n and p.name == "length" and not (p.args or p.kwargs):
        continue
      if isinstance(p, nodes.Getitem) and p.node is n and _const(p.arg, int):
        if not _message_use_opaque(p, up):
          return False
        continue
      return False
    if isinstance(n, nodes.Name) and n.ctx == "load" and n.name in message_names:
      if not _message_use_opaque(n, up):
        return False
  return True


def _is_name(node, name: str) -> bool:
  return isinstance(node, nodes.Name) and node.name == name and node.ctx == "load"


def _const(node, kind) -> bool:
  return isinstance(node, nodes.Const) and type(node.value) is kind


def _field(node, message) -> str | None:
  """The key read from `message` by `node` (`m['key']` or `m.key`), None for any other use."""
  if isinstance(node, nodes.Getitem) and node.node is message and _const(node.arg, str):
    return node.arg.value
  if isinstance(node, nodes.Getattr) and node.node is message:
    return node.attr
  return None


def _message_use_opaque(message, up) -> bool:
  """A message is read for its role (anything may follow) or its content (`_content_use_opaque`)."""
  p = up(message)
  key = _field(p, message)
  if key == "role":
    return True
  return key == "content" and _content_use_opaque(p, up)


def _content_use_opaque(value, up) -> bool:
  """`value` (a content, or a concatenation of one) is written out, tested for truth, or type-tested."""
  p = up(value)
  if isinstance(p, nodes.Output):
    return True
  if isinstance(p, (nodes.Add, nodes.Concat)):
    return _content_use_opaque(p, up)
  if isinstance(p, nodes.Test):
    return p.node is value and p.name in _TYPE_TESTS and not (p.args or p.kwargs)
  return _truth_test(value, up)


def _truth_test(value, up) -> bool:
  """`value` decides only a branch: the test of an `if` or a conditional expression, possibly
  under not / and / or that are such a test themselves."""
  p = up(value)
  if isinstance(p, (nodes.If, nodes.CondExpr)):
    return p.test is value
  if isinstance(p, (nodes.Not, nodes.And, nodes.Or)):
    return _truth_test(p, up)
  return False
