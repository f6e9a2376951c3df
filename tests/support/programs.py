"""Reading a traced program (a jaxpr) in the tests: every equation, the sub-programs' included
(loop bodies, branches, custom rules), with how many times one call runs it."""


def equations(jaxpr, times=1):
  """(equation, runs) of ``jaxpr`` and every jaxpr inside it: a scan's body counted once per
  step (its length), every other sub-program (a branch too) as often as its caller."""
  for eqn in jaxpr.eqns:
    yield eqn, times
    steps = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from equations(inner, steps)
