"""Pure tile policies: ``(target, problem) -> frozen <Op>Tiles``. One module per op."""
