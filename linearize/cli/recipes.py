"""``linearize recipes``: list the shipped recipes, or show one."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from .app import app, console, user_errors


@app.command("recipes")
@user_errors
def recipes_cmd(name: Optional[str] = typer.Argument(None, help="Show this recipe's YAML instead of the list.")):
    """List the shipped recipes, or show one."""
    from .. import recipe as R  # start-up time: the recipe schema imports numpy

    if name is not None:
        console.print(R.find(name).read_text(), highlight=False, markup=False)
        return
    table = Table(title="recipes")
    table.add_column("name")
    table.add_column("feature map")
    table.add_column("window")
    table.add_column("description")
    for n in R.available():
        r = R.load(n)
        att = r["attention"]  # gated delta layers have no feature map: the column names their rule
        fm = att["feature_map"] if att["layer_type"] == "linear_attention" else att["layer_type"].replace("_", " ")
        table.add_row(n, fm, str(att["window"]), r[""]["description"])
    console.print(table)

