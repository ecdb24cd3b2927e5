"""The `kvtier` command."""
import typer
app = typer.Typer()
@app.command()
def info() -> None:
    print("kvtier")
