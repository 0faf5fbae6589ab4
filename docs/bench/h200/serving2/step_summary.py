import collections, sys, json
def analyze(name, c):
    rows=[]
    for line in open(f'r/steps-{name}.txt'):
        p=line.split()
        if p[0]=='MARK': end=float(p[2]); continue
        if len(p)<12: continue
        rows.append([float(x) for x in p])
    d=json.load(open(f'r/c{c}-{name}.json')); dur=d['summary']['duration_s']
    sel=[r for r in rows if end-dur<=r[0]<=end]
    by=collections.defaultdict(list)
    for r in sel: by[(int(r[7]),int(r[8]))].append(r)
    tot=sum(r[1] for r in sel); wait=sum(r[2] for r in sel)
    print(name, f"out tok/s {d['summary']['output_throughput']:.0f}", 'steps',len(sel),'wall',round(dur,2),'busy',round(tot,2),'wait',round(wait,2))
    for T,v in sorted(by.items()):
        if len(v)<5: continue
        med=lambda i: sorted(x[i] for x in v)[len(v)//2]*1000
        print(f'  T,B={T} n={len(v)} total {med(1):.2f} wait {med(2):.2f} sched {med(3):.2f} prep {med(4):.2f} disp {med(5):.2f} proc {med(6):.2f} tokens {med(11)/1000:.0f}  sum {sum(x[1] for x in v):.2f}s')
for a in sys.argv[1:]:
    n,c=a.split(':'); analyze(n,c)
