"""Templated chat prompts: everyday requests (explain, advise, write, compare) crossed with
topics, for training data in the register of the held-out chat prompts without their subjects.

Every prompt is a request template filled with one topic of its kind. The lists hold no topic on
a held-out chat prompt's subject in other words (no browsers or Wi-Fi for "How does the internet
work", no dreams for sleep); on top of that, a topic sharing a content word with a held-out chat
prompt is dropped. The templates' phrasing ("Explain ... to a ten-year-old.") is shared, as the
docstring framings are. The guard covers the `embedded` benchmark set, not MT-Bench or others.

FOLLOW_UPS are second turns ("Can you give me an example?") after the target's own answers to
these requests; they name no subject at all.
"""

from __future__ import annotations

import re

from dflash_local.train.prompts import CHAT_PROMPTS, is_held_out

CONCEPT_TEMPLATES = (
    "What is {topic}?",
    "Explain {topic} in simple terms.",
    "Explain {topic} to a ten-year-old.",
    "Give me three interesting facts about {topic}.",
    "Why is {topic} important?",
    "What are common misconceptions about {topic}?",
    "Describe {topic} in a short paragraph.",
    "How would you explain {topic} to someone who has never heard of it?",
)
# "What are tides?", not "What is tides?"
PLURAL_CONCEPT_TEMPLATES = tuple(
    template.replace("What is", "What are").replace("Why is", "Why are")
    for template in CONCEPT_TEMPLATES
)
CONCEPTS = (
    "a volcano", "an earthquake fault line", "a solar eclipse", "the Milky Way", "a comet",
    "the Big Bang", "a neutron star", "the speed of sound", "magnetism", "static electricity",
    "friction", "buoyancy", "a chemical reaction", "the periodic table", "an atom", "a molecule",
    "rust", "electric current", "a magnet", "a lever", "a pulley", "a microscope", "a telescope",
    "a thermometer", "the immune system", "the human brain", "the digestive system", "a cell",
    "evolution", "natural selection", "genetics", "the ocean floor", "migration of birds",
    "camouflage", "a food chain", "an ecosystem", "biodiversity", "recycling", "composting",
    "air pollution", "deforestation", "the ozone layer", "a hurricane", "a tornado", "lightning",
    "fog", "a thunderstorm", "democracy", "a constitution", "a budget", "a stock market",
    "a credit score", "a mortgage", "compound interest", "trade between countries", "a monopoly",
    "cryptocurrency", "a bank", "insurance", "the Roman Empire", "ancient Egypt", "the Renaissance",
    "the printing press", "the Industrial Revolution", "the Silk Road", "the Great Wall of China",
    "the invention of the telephone", "the first moon landing", "a spreadsheet", "a database",
    "an operating system", "encryption", "a password manager", "open source software",
    "artificial intelligence", "a computer virus", "email spam", "version control",
    "a programming language", "an algorithm", "a pixel", "Bluetooth", "GPS", "a 3D printer",
    "a smartphone camera", "virtual reality", "a robot vacuum", "a prime factorization",
    "a triangle", "the number pi", "statistics", "a graph", "a logarithm", "meditation",
    "mindfulness", "procrastination", "motivation", "empathy", "critical thinking", "memory",
    "a placebo", "protein", "hydration", "a balanced diet", "first aid", "jazz music",
    "an orchestra", "impressionist painting", "poetry", "a novel", "theater", "photography",
    "origami", "a museum", "architecture", "a haiku", "a metaphor", "grammar",
)
PLURAL_CONCEPTS = (
    "the moon's phases", "tides", "acids and bases", "muscles", "bones", "bacteria", "fungi",
    "coral reefs", "rainforests", "deserts", "glaciers", "snowflakes", "taxes", "interest rates",
    "the pyramids", "the Vikings", "the Olympic Games", "binary numbers", "fractions",
    "percentages", "negative numbers", "habits", "nutrition labels", "vitamins",
)

ACTIVITY_TEMPLATES = (
    "Give me three tips for {topic}.",
    "How can I get better at {topic}?",
    "What are common mistakes people make when {topic}?",
    "Make a simple one-week plan for {topic}.",
    "What do I need to get started with {topic}?",
    "What are the benefits of {topic}?",
)
ACTIVITIES = (
    "learning to swim", "running a first 5k", "playing the guitar", "drawing portraits",
    "writing a novel", "keeping a journal", "learning to cook", "baking bread", "training a puppy",
    "taking care of a cat", "birdwatching", "hiking", "camping", "rock climbing", "cycling to work",
    "learning chess", "solving crossword puzzles", "memorizing a speech",
    "preparing for a job interview", "negotiating a salary", "managing a small team",
    "starting a podcast", "writing a blog", "learning photography", "editing videos",
    "learning to type faster", "decluttering a home", "organizing a closet", "planning a road trip",
    "traveling on a budget", "packing light", "moving to a new city", "making new friends",
    "resolving an argument", "giving feedback", "taking notes in class", "preparing for an exam",
    "reading more books", "learning to code", "building a website", "knitting",
    "painting with watercolors", "learning to dance", "singing in a choir", "playing basketball",
    "doing yoga", "lifting weights", "stretching", "meal planning", "budgeting",
    "investing for beginners", "paying off debt", "volunteering", "teaching a class",
    "hosting a dinner party", "writing a cover letter", "running a meeting",
    "learning sign language",
)

SUBJECT_TEMPLATES = (
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a short story about {topic}.",
    "Describe {topic} in vivid detail.",
    "Write a limerick about {topic}.",
    "Write a children's story about {topic}.",
)
SUBJECTS = (
    "a lighthouse in a storm", "a quiet library", "a busy train station",
    "a snowy mountain village", "a dragon who is afraid of fire", "a lost umbrella",
    "an old bookshop", "a summer thunderstorm", "a city at dawn", "a fox in the forest",
    "a penguin who wants to fly", "a grandmother's kitchen", "the first day of school",
    "a broken clock", "a message in a bottle", "a desert at noon", "a spaceship leaving Earth",
    "a marathon runner", "a street musician", "a friendly ghost", "a stray dog", "a pirate ship",
    "a small island", "a kite on a windy day", "a forgotten toy", "an astronaut on Mars",
    "a hot cup of tea", "a winter fireplace", "a mountain lake", "a bakery at five in the morning",
    "a tiny snail", "a clumsy wizard", "a violin", "a carnival at night", "an abandoned castle",
    "a paper boat", "a hummingbird", "the last day of summer", "a traffic jam", "a farmer's market",
    "a rainy Sunday", "a giant tortoise", "a secret door", "a bicycle race", "a moonlit beach",
    "a lonely robot", "a thunder cloud", "a field of sunflowers",
)

MESSAGE_TEMPLATES = (
    "Write a short text message {topic}.",
    "Write a formal letter {topic}.",
)
MESSAGE_PURPOSES = (
    "asking my manager for a day off", "thanking a friend for a birthday gift",
    "apologizing for missing a meeting", "asking a landlord to fix the heating",
    "declining a job offer", "requesting a refund for a broken product",
    "inviting neighbors to a street party", "asking a professor for an extension",
    "following up after a job interview", "cancelling a gym membership",
    "reminding a client about an unpaid invoice", "asking for a letter of recommendation",
    "complaining about a late delivery", "announcing a change of address",
    "thanking a nurse for their care", "proposing a new project idea",
    "asking a friend to return a borrowed book",
)

COMPARE_TEMPLATES = (
    "What is the difference between {topic}?",
    "Explain how {topic} differ.",
)
COMPARISONS = (
    "a crocodile and an alligator", "a frog and a toad", "a rabbit and a hare",
    "tea and coffee", "running and walking", "a lake and a pond", "a hill and a mountain",
    "a democracy and a monarchy", "renting and buying a home", "a debit card and a credit card",
    "stocks and bonds", "a laptop and a desktop computer", "an e-book and a printed book",
    "a violin and a viola", "baking soda and baking powder", "a cold and the flu",
    "a star and a planet", "a meteor and a meteorite", "an ocean and a sea", "a city and a town",
    "a novel and a short story", "a simile and a metaphor", "a poem and a song",
    "socialism and capitalism", "a hurricane and a typhoon", "an introvert and an extrovert",
    "a noun and a verb", "speed and velocity", "mass and weight", "a cello and a double bass",
)

TEMPLATES_BY_KIND = (
    (CONCEPT_TEMPLATES, CONCEPTS),
    (PLURAL_CONCEPT_TEMPLATES, PLURAL_CONCEPTS),
    (ACTIVITY_TEMPLATES, ACTIVITIES),
    (SUBJECT_TEMPLATES, SUBJECTS),
    (MESSAGE_TEMPLATES, MESSAGE_PURPOSES),
    (COMPARE_TEMPLATES, COMPARISONS),
)

# more requests of the same kinds, and new ways of asking about the first
# topics. Appended after the first kinds, so every earlier request keeps its place in
# templated_chat_prompts() (a follow-up is chosen by that place).
MORE_CONCEPT_TEMPLATES = (
    "Tell me about {topic}.",
    "What should everyone know about {topic}?",
    "Explain {topic} with an everyday analogy.",
    "What is the history of {topic}?",
)
MORE_CONCEPTS = (
    "an octopus", "the heart", "blood circulation", "the lungs", "the skeleton", "a fever",
    "an allergy", "antibiotics", "taste buds", "the human eye", "hearing", "DNA", "a gene",
    "a fossil", "a supernova", "an asteroid", "the Sun", "Mars", "Jupiter", "Saturn's rings",
    "inertia", "momentum", "a sound wave", "an echo", "density", "air pressure", "a vacuum",
    "plate tectonics", "a canyon", "a river delta", "a cave", "erosion", "a tsunami",
    "an avalanche", "a monsoon", "a compass", "latitude and longitude", "a time zone",
    "a calendar", "a leap year", "the metric system", "money", "inflation", "a loan", "a contract",
    "a patent", "copyright", "an election", "a parliament", "a jury", "the United Nations",
    "a passport", "a census", "a newspaper", "a keyboard", "a processor", "computer memory",
    "a hard drive", "a variable in programming", "a loop in programming", "a function in programming",
    "object-oriented programming", "a software bug", "unit testing", "fermentation", "yeast",
    "chocolate", "a microwave oven", "a washing machine", "an elevator", "a bridge", "a skyscraper",
    "a tunnel", "a canal", "a submarine", "an airplane wing", "a helicopter", "a hot air balloon",
    "a rocket", "a satellite", "a steam train", "a traffic light", "a roundabout", "the wheel",
    "the alphabet", "a dictionary", "a dialect", "punctuation", "a fable", "a myth", "a fairy tale",
    "Shakespeare", "opera", "ballet", "a symphony", "rhythm", "a chord", "a piano", "sculpture",
    "a mosaic", "a comic book", "animation", "a board game", "soccer", "the offside rule",
    "tennis scoring", "a referee", "teamwork", "leadership", "kindness", "gratitude", "patience",
    "curiosity", "courage", "stress", "anxiety", "happiness", "friendship", "time management",
    "a resume",
)
PLURAL_MORE_CONCEPTS = (
    "dinosaurs", "volcanoes on other planets", "sharks", "bees", "wolves", "elephants", "owls",
    "penguins", "earthquakes", "clouds", "maps", "vaccines for pets", "robots", "calculators",
    "emojis", "traffic jams", "castles", "knights", "pirates", "samurai", "mummies",
)
MORE_ACTIVITIES = (
    "learning a new language", "running a marathon", "swimming laps", "skiing", "surfing",
    "skateboarding", "fishing", "sailing", "playing the piano", "playing the drums",
    "writing poetry", "writing a speech", "studying for a math test", "learning to juggle",
    "playing tennis", "coaching a kids' soccer team", "babysitting", "raising chickens",
    "keeping a fish tank", "brewing coffee", "making pizza at home", "grilling", "cooking rice",
    "making soup", "fixing a flat tire", "painting a room", "building a bookshelf", "sewing",
    "learning calligraphy", "writing a resume", "starting a small business", "saving for retirement",
    "buying a used car", "learning to drive", "parallel parking", "running a book club",
    "learning magic tricks", "reducing screen time", "eating less sugar", "walking more",
    "dealing with stress", "staying organized", "studying abroad", "planning a wedding",
    "teaching kids to read", "learning to ice skate", "playing chess online", "learning history",
)
MORE_SUBJECTS = (
    "a rainy city street", "a cat on a windowsill", "a dog at the beach", "a long train journey",
    "a snowman", "a treasure map", "a brave little mouse", "a king without a crown",
    "a haunted house", "an old sailor", "a new puppy", "a birthday party", "a lost key",
    "a school bus", "a midnight train", "a river at dawn", "a garden gnome", "a city of robots",
    "a talking tree", "a starry night", "a wise owl", "an elephant who never forgets",
    "a race between a snail and a turtle", "a magic paintbrush", "a cloud shaped like a whale",
    "a time traveler", "a shy giraffe", "a chef who cannot cook", "a soccer match",
    "a library after dark", "a desert caravan", "an ice skating rink", "a jazz club",
    "a fisherman's boat", "a windmill", "an old photograph", "a mountain climber",
    "a lost astronaut", "a village fair", "a tiny dragon",
)
MORE_MESSAGE_PURPOSES = (
    "congratulating a coworker on a promotion", "asking a neighbor to feed my cat",
    "welcoming a new team member", "rescheduling a doctor's appointment",
    "asking my bank about a strange charge", "thanking a host after a weekend stay",
    "telling my team about a project delay", "asking a friend for advice",
    "confirming a hotel booking", "asking a school about enrolling my child",
    "wishing a friend good luck before an exam", "returning a wrong order",
    "asking my manager for feedback", "saying goodbye to a team before leaving a job",
    "asking a plumber for a quote", "apologizing to a friend for a late reply",
)
MORE_COMPARISONS = (
    "a bee and a wasp", "a crow and a raven", "a dolphin and a porpoise", "a lion and a tiger",
    "a turtle and a tortoise", "a sheep and a goat", "a river and a stream", "a cave and a tunnel",
    "weather forecasts and horoscopes", "a museum and a gallery", "a poem and a story",
    "a guitar and a ukulele", "a piano and a keyboard", "a comet and an asteroid",
    "Python and JavaScript", "a compiler and an assembler", "a laptop and a tablet",
    "a president and a prime minister", "a loan and a grant", "saving and investing",
    "a recession and a depression", "a town and a village", "jogging and sprinting",
    "a fruit and a vegetable", "a hobby and a job", "a republic and an empire",
    "a fable and a fairy tale", "an acid and an alkali", "an atom and an ion", "a boat and a ship",
)

TEMPLATES_BY_KIND += (
    (CONCEPT_TEMPLATES, MORE_CONCEPTS),
    (PLURAL_CONCEPT_TEMPLATES, PLURAL_MORE_CONCEPTS),
    (ACTIVITY_TEMPLATES, MORE_ACTIVITIES),
    (SUBJECT_TEMPLATES, MORE_SUBJECTS),
    (MESSAGE_TEMPLATES, MORE_MESSAGE_PURPOSES),
    (COMPARE_TEMPLATES, MORE_COMPARISONS),
    (MORE_CONCEPT_TEMPLATES, CONCEPTS),
    (MORE_CONCEPT_TEMPLATES, PLURAL_CONCEPTS),
)

# second turns: what a user asks after an answer, on any subject
FOLLOW_UPS = (
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Tell me more about that.",
    "Summarize that in one sentence.",
    "Why does that matter?",
    "What is a common mistake people make about this?",
    "Could you make it shorter?",
    "Could you put that as a list of key points?",
    "Is there anything surprising about it?",
    "What should I learn next about this?",
)

# grammar and the words of requests, not of subjects: the templates' phrasing may be shared
_STOP_WORDS = frozenset((
    "a", "an", "the", "and", "or", "of", "to", "in", "on", "at", "for", "by", "with", "from",
    "into", "about", "as", "is", "are", "was", "be", "it", "its", "this", "that", "these", "those",
    "what", "why", "how", "who", "which", "when", "where", "does", "do", "can", "could", "would",
    "should", "will", "my", "me", "your", "you", "their", "our", "not", "no", "has", "have", "one",
    "two", "three", "some", "any", "more", "most", "very", "give", "write", "explain", "describe",
    "tell", "get", "keep", "simple", "terms", "example", "examples", "short", "friendly", "ten",
    "year", "old",
))


def templated_chat_prompts() -> list[str]:
    """Every template filled with every topic of its kind, in a fixed order, except topics about
    a held-out chat prompt's subject."""
    held_words = held_out_words()
    return [template.format(topic=topic)
            for templates, topics in TEMPLATES_BY_KIND
            for topic in topics if not _shares_a_word(_content_words(topic), held_words)
            for template in templates]


def held_out_words() -> set[str]:
    """The content words of the held-out chat prompts: what no training prompt may name."""
    return set().union(*(_content_words(p) for p in CHAT_PROMPTS if is_held_out(p)))


def _content_words(text: str) -> set[str]:
    """Words of three letters or more (two say nothing of a subject), without stop words."""
    return {word for word in re.findall(r"[a-z]+", text.lower())
            if len(word) >= 3 and word not in _STOP_WORDS}


def _shares_a_word(words: set[str], others: set[str]) -> bool:
    """One word the start of the other counts: "sleepy" is about sleep, "colleagues" about a
    colleague (no stemmer: "leaf" and "leaves" pass, which the hand-kept lists cover)."""
    return any(word.startswith(other) or other.startswith(word)
               for word in words for other in others)


def follow_up_conversations(answers: dict[str, str]) -> list[list[dict]]:
    """For each templated request in `answers`, the request, the target's answer and one follow-up:
    a conversation going on. The follow-up comes from the request's place in
    templated_chat_prompts(), so it stays the same however many other requests are answered."""
    return [[{"role": "user", "content": request},
             {"role": "assistant", "content": answers[request]},
             {"role": "user", "content": FOLLOW_UPS[number % len(FOLLOW_UPS)]}]
            for number, request in enumerate(templated_chat_prompts()) if answers.get(request)]
