"""The order the files run in, for the two pytest-xdist workers of `make test` (`--dist loadfile`, a file each): the
files without a DeepSpeed test first, while DeepSpeed's ops build in the background; within each group the files
that launch most processes first, so that both workers end together. A file's tests stay together and in order (its
module fixtures are set up once)."""


def order_files(items) -> None:
    """Sort the collected items in place (see the module's docstring)."""
    with_deepspeed = {item.path for item in items if item.get_closest_marker("deepspeed")}
    launches = {}
    for item in items:
        launches[item.path] = launches.get(item.path, 0) + bool(item.get_closest_marker("launch"))
    items.sort(key=lambda item: (item.path in with_deepspeed, -launches[item.path], str(item.path)))
