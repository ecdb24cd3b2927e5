"""The documents and questions that `kvtier demo` plays through.

Short invented texts (a few hundred tokens each): a product manual, a town history, club
rules, a field guide, a timetable. Each turn of the demo asks one question about one
document, and the prompt starts with the whole document, so a document's KV blocks are the
shared prefix that the tiers keep and bring back between turns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Document:
    """One text of the corpus and the questions asked about it, in order."""

    name: str  # a short label for tables
    title: str
    text: str
    questions: tuple[str, ...]


LANTERN_MANUAL = Document(
    name="lantern",
    title="Harrowgate K7 storm lantern: owner's manual",
    text="""\
Thank you for choosing the Harrowgate K7, a storm lantern built for porches, boats and
garden sheds. The K7 runs on two rechargeable cells hidden in the brass base. A full charge
takes about four hours from any ordinary phone charger and gives nine hours of light on the
low setting or three hours on the high setting.

Switching on. Turn the knurled ring under the glass globe clockwise until it clicks once for
low light, twice for high light. A third click starts the amber flicker mode, which imitates
a candle and uses the least power of all: about fourteen hours on a full charge. Turning the
ring back to its starting notch switches the lantern off.

Charging. Lift the rubber flap on the side of the base to find the charging port. A small
green lamp beside the port glows while the lantern charges and goes dark when the cells are
full. Never charge the K7 while it is wet; dry the flap and the port with a cloth first.

Weather. The globe is sealed against rain and spray, and the lantern floats if it falls into
calm water. It is not made for diving: below one metre the seal may leak.

Care. Clean the globe with warm water and a drop of soap. Do not use solvents on the brass,
which darkens slowly over the years; owners who prefer it bright can polish it with a paste of
lemon juice and salt. The cells last about six hundred charges. Replacement cells, part
number HK-220, are sold by any Harrowgate stockist, and the base unscrews with a coin.

Warranty. Harrowgate repairs or replaces any K7 that fails within three years of purchase,
provided the base has not been opened with anything other than a coin.""",
    questions=(
        "How long does the lantern last on the low setting?",
        "What part number do the replacement cells have?",
        "How long is the warranty?",
    ),
)

TOWN_HISTORY = Document(
    name="Velmora",
    title="Velmora: a short history of a river town",
    text="""\
Velmora grew up where the slow green Ansel river bends twice before reaching the sea. The
first settlers, a handful of families of eel fishers, arrived in the spring of 1312 and built
their houses on wooden posts, because the river flooded the meadows every autumn.

For two centuries the town lived on eels, reeds and salt. Reed cutters sold thatch to the
villages inland, and the salt pans south of the river supplied the whole valley. In 1498 the
town council paid for a stone bridge with seven arches, the Sevenfold Bridge, which still
carries the market road today. A toll of one copper coin per cart paid for its upkeep until
the toll was abolished in 1871.

The great flood of 1653 swept away the lower market and the old granary. Afterwards the
council ordered every new house to be built of brick on raised ground, and the town moved
slowly up the eastern hill. The clock tower on the hill, finished in 1702, was built from
bricks of the ruined granary, and its bell was cast from melted fishing weights.

In the nineteenth century Velmora became known for its rope walks. Ropes made from local
hemp were sold to ship builders along the whole coast, and at its peak in 1860 the town had
eleven rope makers. The railway arrived in 1889, and the rope trade faded as steel cable
replaced hemp.

Today Velmora has about nine thousand inhabitants. Its best known event is the Lantern Fair,
held on the first Saturday of October, when boats decorated with lights drift under the
Sevenfold Bridge in memory of the flood.""",
    questions=(
        "In which year did the first settlers arrive?",
        "What was the clock tower built from?",
        "When is the Lantern Fair held?",
    ),
)

GARDEN_RULES = Document(
    name="garden",
    title="Brightwell Terrace community garden: rules for members",
    text="""\
Welcome to the Brightwell Terrace community garden. These rules were agreed by the members'
meeting and keep the garden pleasant for everyone.

Plots. Each household may rent one plot of twelve square metres for a yearly fee of forty
credits, paid in March. A household that leaves its plot untended for eight weeks in the
growing season receives one written reminder; after another four weeks the plot goes to the
next household on the waiting list.

Water. The two rain tanks by the gate are shared. Members water by hand with cans, never with
hoses, and only before ten in the morning or after six in the evening during the summer
months, so that less water evaporates. When the tanks run dry the committee opens the mains
tap, and its use is recorded in the book hanging in the tool shed.

Tools. The shed holds spades, forks, rakes and two wheelbarrows. Tools are cleaned and
returned the same day. The shed code changes on the first day of every season; the new code
is posted to members by the secretary, Mrs Adaeze Fenwick.

Compost. The three compost bays are used in turn: green waste goes into the bay with the
yellow sign, and the committee turns the older bays twice a month. Cooked food, meat and
diseased plants never go into the compost.

Bees. Two hives stand behind the hedge at the north end. Members keep the hedge gap closed
and do not spray any chemicals in the garden at all. Honey from the hives is shared out at
the harvest supper in September.

Disputes go first to the committee, which meets on the second Tuesday of each month in the
shed.""",
    questions=(
        "How much does a plot cost per year?",
        "When may members water in summer?",
        "Who posts the new shed code?",
    ),
)

MOTH_FIELD_GUIDE = Document(
    name="moth",
    title="Field notes: the copperwing moth",
    text="""\
The copperwing moth is a small night-flying moth of the northern heaths, easy to recognise by
the metallic orange sheen on its forewings and the two pale dots near each wing tip. Its
wingspan rarely exceeds three centimetres. Males have feathered antennae; females have thin
ones and are slightly larger.

Life cycle. Females lay their eggs in late August on the undersides of heather leaves, about
forty eggs each. The caterpillars hatch after twelve days, feed through the autumn, and spend
the winter curled inside dry heather stems. In May they spin loose silver cocoons low in the
plant, and the adults emerge in early July.

Migration. Unusually for a moth of its size, the copperwing travels. On warm, still nights in
mid-July large numbers fly south-west towards the coast, guided, it is believed, by the
position of the moon. Observers on the cliffs at Greyhaven once counted more than two
thousand moths passing a single lamp in one hour. Nobody has yet found where the migrants
spend the rest of the summer, and no marked moth has ever been recovered.

Food. The adults drink nectar from heather and honeysuckle and are especially fond of
overripe brambles. They do not feed at all on cold nights and rest with their wings folded
flat, which hides the copper colour and makes them look like dead leaves.

Threats. The moth has declined wherever heaths were ploughed or planted with pines. It is
protected in three nature reserves, and volunteers count it every July with light traps that
release the moths unharmed at dawn.""",
    questions=(
        "How many eggs does a female lay?",
        "Where do the caterpillars spend the winter?",
        "How do volunteers count the moths?",
    ),
)

CORPUS: tuple[Document, ...] = (LANTERN_MANUAL, TOWN_HISTORY, GARDEN_RULES, MOTH_FIELD_GUIDE)
