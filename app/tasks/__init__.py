"""The built-in tasks and models (`builtin:NAME` in `data.train`/`data.val` and `model.path`), built once
and cached under `model.cache_dir` (app/driver.py resolves the names).

    tiny.py   `builtin:tiny` (a tiny Qwen2 with a character tokenizer) and the task `builtin:arith`;
              `builtin:tiny-code`, the same with an ASCII tokenizer
    calc.py   the tool task `builtin:calc` and its model `builtin:tiny-calc`
    code.py   the code task `builtin:code`: tiny stdin/stdout programs scored in the sandbox
"""
