"""Real text prompts for the peer benchmark (`tiergate bench peer`): plain English prose cut
so that the served model's tokenizer gives exactly the workload's prompt length.

Each request's prompt starts at its own seeded word of the corpus below (which wraps around),
so prompts differ from one another and share no prefix, and both servers see the same text.
The length is counted the way tiergate counts a text prompt of /v1/completions (no special
tokens added); SmolLM2 adds no BOS, and neither does llama-server for it (the GGUF's
add_bos_token is false): the benchmark checks both servers' reported prompt_tokens against
this count.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CORPUS", "PeerPrompt", "PromptBuildError", "PromptBuilder"]

# Written for this benchmark: ordinary prose on everyday subjects, about 1,700 words, so that
# the longest prompts of the offline workload rarely wrap around.
CORPUS = """\
The lighthouse on the northern point was built of grey stone that had been carried up the
cliff one block at a time. For most of a century a keeper lived in the small house beside it,
climbing the spiral stairs at dusk to light the lamp and again at dawn to put it out. The
work was repetitive, but it was never quite the same two nights in a row. In winter the wind
came straight off the sea and pressed against the windows until the glass hummed. In summer
the fog rolled in without warning, and the keeper would start the horn and count the seconds
between each blast so that passing ships could tell which headland they were near.

Most of what the keepers wrote down has survived in a row of leather logbooks. They recorded
the weather, the ships they saw, the oil they burned and the repairs they made. Some entries
are only a line long. Others run for pages, describing a storm that tore slates from the roof
or a fishing boat that came too close to the rocks and had to be guided away with lanterns.
Reading them now, one notices how careful the handwriting is, even on the worst nights, as if
keeping the record neat were part of keeping the light itself.

Bread is one of the oldest foods people make, and it is still made in almost the same way.
Flour and water are mixed into a dough, a little salt is added for flavour, and yeast is
given time to work. While the dough rests, the yeast feeds on the sugars in the flour and
releases gas, which the stretchy network of gluten traps in countless small bubbles. A baker
folds the dough now and then to strengthen that network, and after a few hours it has grown
soft and airy. It is shaped, left to rise once more, and baked in a hot oven until the crust
turns brown and sounds hollow when tapped from below.

What makes one loaf better than another is mostly patience. A dough that is given a long,
cool rise develops a deeper taste, because the yeast and the bacteria that live alongside it
have more time to produce the acids and aromas that give good bread its character. Bakers who
keep a sourdough starter feed it every day with fresh flour and water, and some of those
starters have been kept alive for decades, passed from one kitchen to the next like a family
recipe that nobody ever wrote down.

A river begins as rain or melting snow high in the hills. The water gathers in small streams
that run quickly over stones, cutting narrow channels into the slope. As the streams join,
the flow grows larger and slower, and the river starts to wander across the valley floor in
wide loops. On the outside of each bend the current is strong and wears the bank away; on the
inside it is gentle and leaves sand and gravel behind. Over many years the loops move, and a
map drawn a century ago will show the river in places where there are now only fields.

Near the coast the river spreads out and drops the last of the fine mud it has carried. Here
the land is flat and wet, and it belongs as much to the tide as to the river. Twice a day the
sea pushes salt water upstream, and twice a day it draws back again. Birds gather in great
numbers to feed on the worms and shellfish in the mud, and in the autumn the sky above the
marsh fills with long, noisy lines of geese arriving from the north for the winter.

The town library opened in a single rented room above a shop, with a few hundred books that
local families had given away. The first librarian was a retired schoolteacher who worked
without pay and kept the catalogue in a wooden box of handwritten cards. People came in the
evenings after work, and on Saturday mornings the room was so full of children that some of
them sat on the stairs to read. Within ten years the collection had outgrown the room, and
the town raised money for a proper building with tall windows and a reading hall.

The new library had a clock above the door, a map of the county on the wall, and a long table
where anyone could sit for as long as they liked. The librarians who followed the first one
added newspapers, then records, and much later computers, but the long table stayed where it
was. Students wrote their essays there, older people read the news, and strangers passing
through town stopped to look up the history of the place or the name of a plant they had
seen by the road.

Railways changed the way people thought about distance. Before them, a journey of a hundred
miles could take several days by coach, with stops at inns along the way and the constant
risk of a broken wheel or a flooded road. After the first lines were built, the same journey
took a few hours, and it could be made in any season. Towns that had been far apart became
neighbours. Fresh milk, fish and newspapers could reach the city on the morning they were
produced, and people began to live in one place and work in another.

The timetable became one of the most important documents of the age. For trains to run
safely on shared tracks, every clock along the line had to agree, and so the railways set a
single standard time across the whole country. Until then each town had kept its own time by
the sun, a few minutes ahead of or behind its neighbours. The change was resisted at first,
but within a generation it seemed so natural that few people remembered it had ever been
otherwise.

A garden teaches the habit of looking closely. In spring the first green shoots appear before
the last frost has gone, and a gardener learns which of them to protect and which to pull
out. By early summer the beds are crowded, and the work becomes a matter of thinning,
staking and watering in the cool of the evening. Insects arrive in waves: some eat the
leaves, others eat the insects that eat the leaves, and a patient gardener soon notices that
the balance usually settles by itself if it is given a little time.

Late summer brings the harvest. Beans hang in heavy clusters, tomatoes split if they are left
on the vine too long, and there are more courgettes than anyone could possibly eat. Neighbours
trade what they have too much of, and jars of jam and pickles fill the shelves for the winter.
When the first cold nights come, the garden is cut back and covered with a layer of leaves
and compost, and the soil rests until the days grow longer again.

Learning to play a musical instrument is slow, and most of the progress is invisible from one
day to the next. A beginner practises scales that sound the same each time, repeats a short
passage until the fingers find the notes without thought, and listens to recordings of the
piece played far better than they can yet manage. Then one evening, often without any
warning, a phrase that was clumsy for weeks comes out smoothly, and the effort of all those
quiet hours suddenly makes sense.

Good teachers understand this rhythm. They set small goals, praise honest effort, and know
when to move on to something new so that a student does not grow bored. They also know that
the point of practice is not only to play correctly, but to play with feeling, and that a
simple tune played with care can move a listener more than a difficult one played carelessly.

Maps are a kind of argument about what matters. A road map shows the routes between towns and
leaves out the shape of the hills; a walking map shows every footpath and stream but ignores
the motorways. Sailors need charts that mark the depth of the water and the position of rocks,
while a map of a city's underground railway bends the streets out of their true shape so that
the lines and stations are easy to follow. Each of them is accurate in its own way, and each
is useless for someone with a different purpose.

The oldest surviving maps were scratched into clay or painted on silk, and they mixed what the
makers knew with what they imagined. Unknown coasts were filled with invented islands, and the
edges of the world were decorated with sea monsters. Over the centuries surveyors walked the
land with chains and measuring wheels, sailors took careful readings of the stars, and the
blank spaces slowly filled in, until today a satellite can place a point on the ground to
within a few centimetres.

Weather forecasting began with simple observation. Farmers and sailors learned to read the
shape of the clouds, the colour of the evening sky and the behaviour of animals, and many of
their sayings contain a grain of truth. The modern forecast grew from a network of stations
that measured the pressure, temperature and wind at the same hour each day and sent the
numbers by telegraph to a central office, where they were drawn on a chart. Patterns appeared
on those charts that no single observer could have seen.

Today the numbers are fed into computer models that divide the atmosphere into millions of
small boxes and calculate how the air in each one will move and change. The forecasts are far
better than they were, especially for the next few days, but the atmosphere is sensitive to
small differences, and beyond a week or two even the best models can only speak of chances.
A good forecaster still looks out of the window before going on the air.
"""


class PromptBuildError(ValueError):
    """No cut of the corpus gives the requested number of tokens."""


@dataclass(frozen=True)
class PeerPrompt:
    """One request's prompt text and its length in tokens (as tiergate counts it)."""

    text: str
    num_tokens: int


class PromptBuilder:
    """Cuts the corpus into prompts of exact token lengths.

    `count_tokens` is the served model's tokenizer (e.g. `lambda t: len(tokenizer.encode(t,
    add_special_tokens=False))`). A prompt is the corpus from a start word on, cut at the
    shortest run of whole words that reaches the length; when the last word overshoots, it is
    cut at a character, and when no cut of it fits either, the start moves one word on.
    """

    def __init__(
        self, count_tokens: Callable[[str], int], corpus: str = CORPUS, *, max_tries: int = 64
    ) -> None:
        self.count_tokens = count_tokens
        self.words: Sequence[str] = corpus.split()
        if not self.words:
            raise PromptBuildError("the corpus has no words")
        self.max_tries = max_tries

    def build(self, num_tokens: int, start_word: int = 0) -> PeerPrompt:
        """The prompt of exactly num_tokens tokens starting at (or soon after) start_word."""
        if num_tokens < 1:
            raise PromptBuildError(f"a prompt needs at least one token, not {num_tokens}")
        for attempt in range(self.max_tries):
            text = self._cut(num_tokens, (start_word + attempt) % len(self.words))
            if text is not None:
                return PeerPrompt(text, num_tokens)
        raise PromptBuildError(
            f"no cut of the corpus gives {num_tokens} tokens (from word {start_word}, "
            f"{self.max_tries} starts tried)"
        )

    def build_all(self, lengths: Sequence[int], seed: int) -> list[PeerPrompt]:
        """One prompt per length, each from a seeded start word, no two the same while the
        corpus has words enough (so no two prompts share a prefix, which a server's prefix
        cache would serve); word 0 is left to the warm-up prompt."""
        rng = random.Random(seed)
        num_words = len(self.words)
        if len(lengths) < num_words:
            starts = rng.sample(range(1, num_words), len(lengths))
        else:
            starts = [rng.randrange(num_words) for _ in lengths]
        return [self.build(length, start) for length, start in zip(lengths, starts, strict=True)]

    def _words_from(self, start: int, num_words: int) -> str:
        n = len(self.words)
        return " ".join(self.words[(start + i) % n] for i in range(num_words))

    def _cut(self, num_tokens: int, start: int) -> str | None:
        # Every word is at least one token, so num_tokens words always reach the length:
        # the smallest word count that does, by bisection (the count grows with the words).
        low, high = 1, num_tokens
        while low < high:
            middle = (low + high) // 2
            if self.count_tokens(self._words_from(start, middle)) >= num_tokens:
                high = middle
            else:
                low = middle + 1
        text = self._words_from(start, low)
        if self.count_tokens(text) == num_tokens:
            return text
        # The last word overshoots: try it cut short, longest first.
        head = self._words_from(start, low - 1)
        last = self.words[(start + low - 1) % len(self.words)]
        for end in range(len(last) - 1, 0, -1):
            candidate = f"{head} {last[:end]}" if head else last[:end]
            if self.count_tokens(candidate) == num_tokens:
                return candidate
        return None
