#!/usr/bin/env python3
"""Every stage and source header says the same four things in the same place: its top
comment (before #pragma once) has paragraphs that start with `Threads:`, `Errors:`,
`Memory:` and `Checkpoints:`, in that order, after its description and example.

Checked: every .hpp directly in include/ferry/stages/ and include/ferry/sources/, less the
helpers below that define no stage or source. Prints one line per problem, naming the
header, and exits 1 when there is one (0 when all pass). Run from anywhere:
    python3 docs/api/check_blocks.py"""
import os
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
DIRS = ['include/ferry/stages', 'include/ferry/sources']
LABELS = ['Threads:', 'Errors:', 'Memory:', 'Checkpoints:']

# Headers in those folders that define no stage or source: nothing runs, so no block.
HELPERS = {
    'include/ferry/sources/array_meta.hpp': 'the shape and dtype of an npy/IDX array: a value type',
    'include/ferry/sources/compression.hpp': 'the compression enum of file formats: an option',
    'include/ferry/sources/example.hpp': 'parse_example, a function map() calls on records: no stage',
    'include/ferry/sources/file_options.hpp': "from_files' format and option structs: options",
    'include/ferry/sources/fixed_length.hpp': 'a from_files format tag (the source is from_files)',
    'include/ferry/sources/idx.hpp': 'a from_files format tag (the source is from_files)',
    'include/ferry/sources/npy.hpp': 'a from_files format tag (the source is from_files)',
    'include/ferry/sources/record.hpp': "the record value type and its borrowed views: a value type",
    'include/ferry/sources/text_lines.hpp': 'a from_files format tag (the source is from_files)',
    'include/ferry/sources/tfrecord.hpp': 'a from_files format tag (the source is from_files)',
}


def top_comment(path):
    """The header's leading // lines (up to #pragma once), their text without the //."""
    out = []
    with open(path, encoding='utf-8') as f:
        for line in f:
            s = line.strip()
            if s.startswith('#pragma once'):
                break
            if s.startswith('//'):
                out.append(s[2:].strip())
            elif s:
                break
    return out


def paragraphs(lines):
    """Blank-// separated paragraphs, as the first line of each."""
    firsts, new = [], True
    for text in lines:
        if not text:
            new = True
        elif new:
            firsts.append(text)
            new = False
    return firsts


def check(rel):
    lines = top_comment(os.path.join(ROOT, rel))
    if not lines:
        return ['no top comment before #pragma once']
    firsts = paragraphs(lines)
    problems = []
    at = []
    for label in LABELS:
        hits = [i for i, p in enumerate(firsts) if p.startswith(label)]
        if not hits:
            problems.append(f'no paragraph starting with "{label}" (a // line before it)')
        elif len(hits) > 1:
            problems.append(f'{len(hits)} paragraphs start with "{label}"')
        else:
            at.append((hits[0], label))
    if [label for _, label in sorted(at)] != [label for _, label in at]:
        problems.append('out of order: ' + ', '.join(label for _, label in sorted(at)) +
                        ' (want ' + ', '.join(LABELS) + ')')
    if at and min(i for i, _ in at) == 0:
        problems.append('the block comes first: the description and example go before it')
    return problems


def main():
    failed = 0
    headers = []
    for d in DIRS:
        for name in sorted(os.listdir(os.path.join(ROOT, d))):
            rel = f'{d}/{name}'
            if name.endswith('.hpp') and os.path.isfile(os.path.join(ROOT, rel)):
                headers.append(rel)
    for rel in sorted(set(HELPERS) - set(headers)):
        print(f'{rel}: listed as a helper but not found (update HELPERS in {__file__})')
        failed += 1
    checked = 0
    for rel in headers:
        if rel in HELPERS:
            continue
        checked += 1
        for p in check(rel):
            print(f'{rel}: {p}')
            failed += 1
    if failed:
        print(f'check_blocks: {failed} problem(s) in the Threads / Errors / Memory / Checkpoints blocks')
        return 1
    print(f'check_blocks: {checked} stage and source headers have Threads / Errors / Memory / Checkpoints')
    return 0


if __name__ == '__main__':
    sys.exit(main())
