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
        table.add_row(n, r["attention"]["feature_map"], str(r["attention"]["window"]), r[""]["description"])
    console.print(table)

