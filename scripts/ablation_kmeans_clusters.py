"""Stand-in head types for `attnkit ablate --experiment types` until `attnkit cluster` lands.

KMeans(k=4) over the 21 distance features (Guan et al. Eq. 2: cls, sep, comma, period, self, win_0..15)
of every head, measured with attnkit.extract on STS-B sentences, then each cluster is named after
Guan et al.'s types by its centroid:
  diagonal       — the most weight on the token itself and its neighbours (self + prev + next: the
                   features beside the 21; on ~15-token sentences win_0 is empty, d = 1 falls in win_1);
  vertical       — of the rest, the most weight on [CLS]/[SEP]/comma/period;
  dense+vertical — of the last two, the more special-token weight;
  dense          — the remaining one.
Writes RUN/clusters.json as {"heads": [{"layer", "head", "label", "type"}], ...} and RUN/features.npz.

    python scripts/ablation_kmeans_clusters.py /work/shared/data/stsb/dev.tsv RUN [N_SENTENCES]
"""
import csv
import json
import sys

import numpy as np
from sklearn.cluster import KMeans

import attnkit


def main(tsv, run, n=500):
    with open(tsv, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    every = list(dict.fromkeys(s for r in rows for s in (r["sentence1"], r["sentence2"])))
    # evenly spaced over the file: STS-B dev is sorted by genre (captions first, then news, forums)
    sents = [every[int(i)] for i in np.linspace(0, len(every) - 1, min(n, len(every))).round()]
    feats = attnkit.extract(sents, progress=True)
    feats.save(run)
    L, H, _ = feats.mean.shape
    names = list(feats.names)
    X = feats.mean[:, :, :21].reshape(L * H, 21)  # cls, sep, comma, period, self, win_0..win_15
    km = KMeans(n_clusters=4, n_init=20, random_state=0).fit(X)
    C = km.cluster_centers_
    lab = km.labels_
    flat = feats.mean.reshape(L * H, -1)
    near = flat[:, names.index("self")] + flat[:, names.index("prev")] + flat[:, names.index("next")]
    local = np.array([near[lab == c].mean() for c in range(4)])
    special = C[:, [names.index(k) for k in ("cls", "sep", "comma", "period")]].sum(1)
    left = list(range(4))
    diag = max(left, key=lambda c: local[c]); left.remove(diag)
    vert = max(left, key=lambda c: special[c]); left.remove(vert)
    dv = max(left, key=lambda c: special[c]); left.remove(dv)
    naming = {diag: "diagonal", vert: "vertical", dv: "dense+vertical", left[0]: "dense"}
    heads = [{"layer": i // H, "head": i % H, "label": int(lab), "type": naming[int(lab)]}
             for i, lab in enumerate(km.labels_)]
    out = {"heads": heads, "k": 4, "method": "KMeans(k=4, n_init=20, random_state=0) on 21 distance features",
           "n_sentences": len(sents), "centroids": {naming[c]: dict(zip(names[:21], map(float, C[c]))) for c in range(4)}}
    with open(f"{run}/clusters.json", "w") as f:
        json.dump(out, f, indent=1)
    for c in range(4):
        members = [f"L{h['layer']}H{h['head']}" for h in heads if h["label"] == c]
        print(f"{naming[c]:15s} n={len(members):2d} special={special[c]:.2f} self+prev+next={local[c]:.2f}: {' '.join(members)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 500)
