"""What a streamed answer holds back: the start of a tag whose rest has not come yet."""


def tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` begins with (short of all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
