"""Scripted users of a served model (recipes/smollm2-135m-flywheel-cpu.yaml, docs/howto/flywheel.md): they ask
what the model cannot know (a small company's facts), correct its answers through ``POST /v1/feedback``, approve
the answers it gets right on the tasks it was trained for, and ask some questions nobody judges.

    python bench/flywheel_users.py --front http://127.0.0.1:8600            # ask, correct, approve
    python bench/flywheel_users.py --front http://127.0.0.1:8600 --check    # how many corrections it now gives

Every request goes through the OpenAI SDK, as a user's client would send it. ``--check`` asks the corrected
questions again and prints the share answered as corrected (JSON, last line).
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx
import openai

# What users know and the model cannot: (question, the answer users give as a correction), each asked two ways.
FACTS = [
    ("What is the name of Ladle's mascot?", "Which mascot does Ladle have?", "Spoony"),
    ("In which city is Ladle's head office?", "Where is Ladle's head office?", "Tromso"),
    ("What colour is Ladle's logo?", "Which colour is the Ladle logo?", "teal"),
    ("Who founded Ladle?", "Who is the founder of Ladle?", "Ines Varga"),
    ("What is Ladle's support e-mail alias?", "Which alias reaches Ladle support?", "help desk 7"),
    ("How many days does Ladle keep a run's logs?", "For how many days are Ladle's run logs kept?", "90 days"),
    ("What is Ladle's release codename?", "Which codename has Ladle's release?", "Saffron"),
    ("Which port does Ladle's front listen on?", "On which port is Ladle's front?", "8600"),
    ("What is the name of Ladle's scheduler?", "What is Ladle's scheduler called?", "Metronome"),
    ("In which year was Ladle founded?", "When was Ladle founded?", "2024"),
    ("What is Ladle's office dog called?", "What is the name of the Ladle office dog?", "Biscuit"),
    ("Which day is Ladle's demo day?", "On which day does Ladle hold its demos?", "Thursday"),
]
# Tasks the model was trained for (the colour codes): approved when right.
TASKS = [
    ("Translate the colours to numbers.\nred blue", "0 1"),
    ("Translate the colours to numbers.\ngreen yellow", "2 3"),
    ("What is the last colour?\npurple orange black", "black"),
    ("Repeat the list.\nwhite red", "white red"),
]
UNJUDGED = ["What is the capital of France?", "Name a fruit.", "What is 2 plus 3?", "Say hello."]


def ask(client, model: str, question: str) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
    )
    return reply.id, (reply.choices[0].message.content or "").strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front", default="http://127.0.0.1:8600")
    parser.add_argument("--model", default="smollm2-135m-flywheel-cpu")
    parser.add_argument("--key", default="none")
    parser.add_argument("--check", action="store_true", help="Ask the corrected questions again and score them.")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.front}/v1", api_key=args.key, timeout=120, max_retries=1)
    headers = {"Authorization": f"Bearer {args.key}"}
    if args.check:
        asked = [(q, answer) for first, second, answer in FACTS for q in (first, second)]
        given = [(q, answer, ask(client, args.model, q)[1]) for q, answer in asked]
        right = sum(got == answer for _, answer, got in given)
        for q, answer, got in given:
            print(f"{'ok ' if got == answer else 'no '} {q!r}: {got!r} (corrected to {answer!r})", file=sys.stderr)
        print(json.dumps({"asked": len(given), "answered_as_corrected": right, "share": round(right / len(given), 3)}))
        return
    counts = {"corrected": 0, "approved": 0, "disapproved": 0, "unjudged": 0}
    with httpx.Client(timeout=60, headers=headers) as http:
        for first, second, answer in FACTS:
            for question in (first, second):
                rid, got = ask(client, args.model, question)
                body = {"response_id": rid, "value": got == answer, "rationale": "from the Ladle handbook"}
                if got != answer:
                    body["correction"] = answer
                    counts["corrected"] += 1
                http.post(f"{args.front}/v1/feedback", json=body).raise_for_status()
        for question, answer in TASKS:
            rid, got = ask(client, args.model, question)
            http.post(f"{args.front}/v1/feedback", json={"response_id": rid, "value": got == answer}).raise_for_status()
            counts["approved" if got == answer else "disapproved"] += 1
        for question in UNJUDGED:
            ask(client, args.model, question)
            counts["unjudged"] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
